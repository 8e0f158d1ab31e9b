//! The checkpoint's manifests as the target reads them: the final dump's (and each
//! other container's), and the final image directory one names.

use podmotion_wire::agent::Manifest;
use std::path::{Path, PathBuf};
use tonic::Status;

/// The directory of the final images of the checkpoint in `dir`, as its manifest
/// names it.
pub(super) fn final_images(dir: &Path) -> Result<PathBuf, Status> {
    final_dir(dir, &read_manifest(dir)?)
}

pub(super) fn read_manifest(dir: &Path) -> Result<Manifest, Status> {
    read_manifest_named(dir, "manifest.json")
}

pub(super) fn read_manifest_named(dir: &Path, name: &str) -> Result<Manifest, Status> {
    let bytes =
        std::fs::read(dir.join(name)).map_err(|e| Status::data_loss(format!("{name}: {e}")))?;
    serde_json::from_slice(&bytes).map_err(|e| Status::data_loss(format!("{name}: {e}")))
}

/// The final image dir a manifest names: one plain directory inside the checkpoint
/// dir (never a link, never a path out of it).
pub(super) fn final_dir(dir: &Path, manifest: &Manifest) -> Result<PathBuf, Status> {
    let name = &manifest.final_dir;
    if podmotion_wire::transfer::check_image_path(name).is_err() || name.contains('/') {
        return Err(Status::data_loss(format!(
            "manifest names final dir {name:?}: not a directory of the checkpoint"
        )));
    }
    let p = dir.join(name);
    match std::fs::symlink_metadata(&p) {
        Ok(md) if md.is_dir() => Ok(p),
        _ => Err(Status::data_loss(format!(
            "manifest names final dir {name:?}: not a directory of the checkpoint"
        ))),
    }
}
