#!/usr/bin/env bash
# Parses every ```mermaid block of README.md and docs/*.md with Mermaid's own parser
# (mermaid.parse, Mermaid 11 under Node.js with jsdom for the DOM it expects; no
# browser) and fails naming each block that does not parse (file:line and Mermaid's
# message). The pictures themselves are drawn by whatever shows the Markdown (GitHub
# renders Mermaid blocks); this check keeps their source well-formed.
#
#   bash hack/check-mermaid.sh
#
# Needs node (18 or later) and npm. The parser's packages are pinned in
# hack/mermaid/package-lock.json and installed with `npm ci` into
# ${PODMOTION_CACHE:-~/.cache/podmotion}/mermaid-<hash of the lock>/ (once per lock;
# about 170 MB), never into the tree.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cache=${PODMOTION_CACHE:-$HOME/.cache/podmotion}

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "[mermaid] node and npm are needed (Debian: apt-get install nodejs npm)" >&2
  exit 1
fi

lock_hash=$(cat "$here/mermaid/package.json" "$here/mermaid/package-lock.json" | sha256sum | cut -c1-16)
dir=$cache/mermaid-$lock_hash
if [[ ! -f $dir/.installed ]]; then
  echo "[mermaid] installing the pinned parser into $dir (npm ci)" >&2
  rm -rf "$dir"
  mkdir -p "$dir"
  cp "$here/mermaid/package.json" "$here/mermaid/package-lock.json" "$dir/"
  (cd "$dir" && npm ci --no-audit --no-fund --ignore-scripts >&2)
  touch "$dir/.installed"
fi

cat >"$dir/check.mjs" <<'JS'
// Reads the Markdown files named on the command line, parses each ```mermaid block.
import { readFileSync } from 'node:fs';
import { JSDOM } from 'jsdom';
const dom = new JSDOM('<!doctype html><html><body></body></html>');
globalThis.window = dom.window;
globalThis.document = dom.window.document;
const { default: mermaid } = await import('mermaid');
mermaid.initialize({ startOnLoad: false });
let blocks = 0, bad = 0;
for (const file of process.argv.slice(2)) {
  const lines = readFileSync(file, 'utf8').split('\n');
  for (let i = 0; i < lines.length; i++) {
    if (!/^```mermaid\s*$/.test(lines[i])) continue;
    const start = i + 1;
    const body = [];
    for (i++; i < lines.length && !/^```\s*$/.test(lines[i]); i++) body.push(lines[i]);
    if (i >= lines.length) { console.error(`${file}:${start}: unterminated mermaid block`); bad++; break; }
    blocks++;
    try {
      const r = await mermaid.parse(body.join('\n'));
      console.error(`${file}:${start}: ${r.diagramType}, ${body.length} lines: ok`);
    } catch (e) {
      bad++;
      console.error(`${file}:${start}: does not parse: ${String(e.message ?? e)}`);
    }
  }
}
if (blocks === 0) { console.error('no mermaid block found'); process.exit(1); }
process.exit(bad ? 1 : 0);
JS

cd "$root"
files=(README.md docs/*.md)
(cd "$dir" && node check.mjs "${files[@]/#/$root/}")
