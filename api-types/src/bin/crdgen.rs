//! Writes `crds/<kind>.yaml` for every PodMotion CRD (or, with `--check`, fails when
//! a committed file differs).
#![forbid(unsafe_code)]

use std::path::PathBuf;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let check = args.iter().any(|a| a == "--check");
    let dir = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds"));
    let mut drift = false;
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
            std::fs::write(&path, want).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
            println!("wrote {}", path.display());
        }
    }
    if drift {
        eprintln!("run `cargo run -p podmotion-api --bin crdgen` and commit crds/");
        std::process::exit(1);
    }
}
