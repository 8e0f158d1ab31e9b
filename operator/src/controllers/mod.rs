//! Thin controllers: wiring, fetching inputs, calling a pure core, applying its output.
//! Each exposes `run(ctx) -> anyhow::Result<()>` and is enabled by `--controllers`.
