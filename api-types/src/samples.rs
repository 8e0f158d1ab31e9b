//! The example manifests under `examples/`: valid ones that every check must accept,
//! and invalid ones, each with the message its rejection must contain.
//!
//! An invalid sample starts with a `# expect: <text>` line. It holds one YAML
//! document (a create that must be rejected) or two (an object that is accepted,
//! then an update of it that must be rejected). The unit tests evaluate them against
//! the generated schemas and CEL rules; the e2e tests send them to the real API
//! server with server-side dry-run.

use std::path::{Path, PathBuf};

use serde_json::Value;

/// One example manifest file.
#[derive(Clone, Debug)]
pub struct Sample {
    /// The file it was read from.
    pub path: PathBuf,
    /// For an update sample, the object that exists first.
    pub old: Option<Value>,
    /// The object that is created or applied as an update.
    pub object: Value,
    /// For invalid samples, text the rejection message must contain.
    pub expect: Option<String>,
}

impl Sample {
    /// Parses a sample file's text.
    pub fn parse(path: &Path, text: &str) -> Result<Sample, String> {
        let expect = text
            .lines()
            .find_map(|l| l.strip_prefix("# expect:"))
            .map(|s| s.trim().to_string());
        let docs: Vec<Value> = serde_saphyr::from_multiple(text)
            .map_err(|e| format!("{}: not YAML: {e}", path.display()))?;
        let mut docs: Vec<Value> = docs.into_iter().filter(|d| !d.is_null()).collect();
        let (old, object) = match docs.len() {
            1 => (None, docs.remove(0)),
            2 => {
                let object = docs.remove(1);
                (Some(docs.remove(0)), object)
            }
            n => return Err(format!("{}: {n} documents; want 1 or 2", path.display())),
        };
        Ok(Sample {
            path: path.to_path_buf(),
            old,
            object,
            expect,
        })
    }

    /// `kind` of the object.
    pub fn kind(&self) -> &str {
        self.object
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default()
    }

    /// File name, for messages.
    pub fn name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// The repository's root: the parent of the running package's directory.
///
/// Read at run time first (cargo sets `CARGO_MANIFEST_DIR` for `cargo test` and
/// `cargo run`), the compiled-in path only as a fallback: cargo reuses a crate built in
/// another checkout of the same tree (one shared target directory, paths compared
/// relative to the package), and the compiled-in path then names that other checkout,
/// which may be gone.
pub fn repo_root() -> PathBuf {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    dir.parent().map(Path::to_path_buf).unwrap_or(dir)
}

/// The repository's `examples/` directory.
pub fn examples_dir() -> PathBuf {
    repo_root().join("examples")
}

/// Every `*.yaml` sample in `dir`, sorted by file name.
pub fn load_dir(dir: &Path) -> Result<Vec<Sample>, String> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
            Sample::parse(p, &text)
        })
        .collect()
}
