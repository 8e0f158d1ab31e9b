//! Writes `crds/<kind>.yaml` for every PodMotion CRD, and the Helm chart's copy in
//! `charts/podmotion/files/crds/` (or, with `--check`, fails when a committed file
//! differs). With a directory argument it writes only there.
#![forbid(unsafe_code)]

use std::path::PathBuf;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let check = args.iter().any(|a| a == "--check");
    let root = podmotion_api::samples::repo_root();
    let dirs: Vec<PathBuf> = match args.iter().find(|a| !a.starts_with("--")) {
        Some(dir) => vec![PathBuf::from(dir)],
        None => vec![root.join("crds"), root.join("charts/podmotion/files/crds")],
    };
    let mut drift = false;
    for dir in &dirs {
        for (stem, crd) in podmotion_api::crds::all() {
            let path = dir.join(format!("{stem}.yaml"));
            let want = podmotion_api::crds::to_yaml(&crd);
            if check {
                let have = std::fs::read_to_string(&path).unwrap_or_default();
                if have != want {
                    eprintln!("{} is out of date", path.display());
                    drift = true;
                }
            } else {
                std::fs::create_dir_all(dir)
                    .unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
                std::fs::write(&path, want)
                    .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
                println!("wrote {}", path.display());
            }
        }
    }
    if drift {
        eprintln!("run `cargo run -p podmotion-api --bin crdgen` and commit crds/ and charts/");
        std::process::exit(1);
    }
}
