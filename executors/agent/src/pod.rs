//! The containers of a migrating pod as `Prepare` names them, and where each one's
//! images live in the migration's checkpoint directory.
//!
//! The operator names the pod's containers by name and ID (`PrepareRequest.containers`,
//! in the pod's order); the single-container wire (`container_ids`, its first ID) is
//! the one-element case of that list. A name pairs a source container with the target
//! pod's container that restores it, and names its image directories, so both agents
//! compute the same layout without any other agreement: the first container keeps the
//! single-container layout (`pre-<n>`, `final`, `manifest.json`), so a one-container
//! pod's images are byte for byte what they always were; every other container's carry
//! its name (`pre-<n>.<name>`, `final.<name>`, `manifest.<name>.json`). Those names
//! keep the stream's order (pre-copy rounds, then final dumps, then the manifests, the
//! last of which tells the target the image set is complete) and the one-level paths
//! the image stream accepts (`podmotion_wire::transfer::check_image_path`).
//!
//! Everything here is pure: validation and names, no I/O.

use podmotion_wire::agent::PrepareRequest;
use tonic::Status;

/// The most containers one migration moves. Kubernetes sets no bound; this one bounds
/// the work (and the broker registrations) one `Prepare` can ask for, far above any
/// pod seen in practice (an application, a mesh proxy, a log shipper, a few more).
pub const MAX_CONTAINERS: usize = 16;

/// The longest container name (a DNS label).
const MAX_NAME_LEN: usize = 63;

/// One container of the pod: its name (none on the single-container wire, which never
/// carried one) and its ID as the kubelet reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodContainer {
    pub name: Option<String>,
    pub id: String,
}

/// The pod's containers in the operator's order (see the module docs); never empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodPlan {
    containers: Vec<PodContainer>,
}

impl PodPlan {
    /// The containers a `Prepare` names: `containers` where set, else the first of
    /// `container_ids` (the single-container wire). Invalid arguments: nothing named, a
    /// name that is not a DNS label, a name given twice, an empty ID, more than
    /// [`MAX_CONTAINERS`].
    pub fn from_request(r: &PrepareRequest) -> Result<PodPlan, Status> {
        if r.containers.is_empty() {
            let Some(id) = r.container_ids.first() else {
                return Err(Status::invalid_argument(
                    "no container was named: set containers (or container_ids)",
                ));
            };
            return Ok(PodPlan {
                containers: vec![PodContainer {
                    name: None,
                    id: id.clone(),
                }],
            });
        }
        if r.containers.len() > MAX_CONTAINERS {
            return Err(Status::invalid_argument(format!(
                "{} containers named: at most {MAX_CONTAINERS} move with one migration",
                r.containers.len()
            )));
        }
        let mut out: Vec<PodContainer> = Vec::with_capacity(r.containers.len());
        for c in &r.containers {
            check_name(&c.name)?;
            if out
                .iter()
                .any(|o| o.name.as_deref() == Some(c.name.as_str()))
            {
                return Err(Status::invalid_argument(format!(
                    "container {:?} is named twice",
                    c.name
                )));
            }
            if c.id.is_empty() {
                return Err(Status::invalid_argument(format!(
                    "container {:?}: no container ID",
                    c.name
                )));
            }
            out.push(PodContainer {
                name: Some(c.name.clone()),
                id: c.id.clone(),
            });
        }
        Ok(PodPlan { containers: out })
    }

    /// The first container: the one the single-container layout belongs to.
    pub fn first(&self) -> &PodContainer {
        &self.containers[0]
    }

    pub fn containers(&self) -> &[PodContainer] {
        &self.containers
    }

    /// More than one container moves.
    pub fn is_multi(&self) -> bool {
        self.containers.len() > 1
    }

    /// The containers' names, `, `-separated, for messages (`<unnamed>` on the
    /// single-container wire).
    pub fn names(&self) -> String {
        self.containers
            .iter()
            .map(|c| c.name.as_deref().unwrap_or("<unnamed>"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The layout of container `index`'s images (see the module docs).
    pub fn layout(&self, index: usize) -> Layout {
        let c = &self.containers[index];
        Layout {
            suffix: if index == 0 { None } else { c.name.clone() },
        }
    }
}

/// Where one container's images live inside the checkpoint directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// `None`: the single-container layout (the pod's first container).
    suffix: Option<String>,
}

impl Layout {
    /// The directory of pre-copy round `n` (from 1).
    pub fn pre_dir(&self, n: u32) -> String {
        self.with_suffix(&format!("pre-{n}"))
    }

    /// The directory of the final dump.
    pub fn final_dir(&self) -> String {
        self.with_suffix("final")
    }

    /// CRIU's parent link from a round to round `n` (`--prev-images-dir`, relative to
    /// the round's own directory).
    pub fn parent_link(&self, n: u32) -> String {
        format!("../{}", self.pre_dir(n))
    }

    /// The manifest the target restores this container from.
    pub fn manifest(&self) -> String {
        match &self.suffix {
            None => "manifest.json".into(),
            Some(s) => format!("manifest.{s}.json"),
        }
    }

    fn with_suffix(&self, base: &str) -> String {
        match &self.suffix {
            None => base.to_owned(),
            Some(s) => format!("{base}.{s}"),
        }
    }
}

/// A container name as Kubernetes allows it: a DNS label (`[a-z0-9-]`, 1–63
/// characters, no `-` at either end). Nothing else may name a directory of the
/// checkpoint.
fn check_name(name: &str) -> Result<(), Status> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "container name {name:?} is not a DNS label ([a-z0-9-], 1-63 characters)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use podmotion_wire::agent::ContainerRef;
    use podmotion_wire::transfer::check_image_path;

    fn named(list: &[(&str, &str)]) -> PrepareRequest {
        PrepareRequest {
            containers: list
                .iter()
                .map(|(n, i)| ContainerRef {
                    name: (*n).into(),
                    id: (*i).into(),
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_single_container_wire_is_the_one_element_case() {
        let r = PrepareRequest {
            container_ids: vec!["containerd://a".into(), "containerd://b".into()],
            ..Default::default()
        };
        let p = PodPlan::from_request(&r).unwrap();
        assert!(!p.is_multi());
        assert_eq!(
            p.first(),
            &PodContainer {
                name: None,
                id: "containerd://a".into()
            }
        );
        let one = PodPlan::from_request(&named(&[("app", "containerd://a")])).unwrap();
        assert!(!one.is_multi());
        // Either way the images are where a single-container migration always put them.
        for plan in [&p, &one] {
            let l = plan.layout(0);
            assert_eq!(
                (l.pre_dir(2), l.final_dir(), l.parent_link(1), l.manifest()),
                (
                    "pre-2".to_string(),
                    "final".to_string(),
                    "../pre-1".to_string(),
                    "manifest.json".to_string()
                )
            );
        }
    }

    #[test]
    fn containers_take_precedence_over_container_ids_and_keep_their_order() {
        let mut r = named(&[("proxy", "containerd://p"), ("app", "containerd://a")]);
        r.container_ids = vec!["containerd://ignored".into()];
        let p = PodPlan::from_request(&r).unwrap();
        assert!(p.is_multi());
        assert_eq!(p.names(), "proxy, app");
        assert_eq!(p.first().id, "containerd://p");
        assert_eq!(p.containers()[1].id, "containerd://a");
    }

    #[test]
    fn every_other_container_has_image_dirs_of_its_own_that_the_stream_accepts() {
        let p = PodPlan::from_request(&named(&[
            ("app", "containerd://a"),
            ("log-shipper", "containerd://l"),
        ]))
        .unwrap();
        let (a, l) = (p.layout(0), p.layout(1));
        assert_eq!(l.pre_dir(3), "pre-3.log-shipper");
        assert_eq!(l.final_dir(), "final.log-shipper");
        assert_eq!(l.parent_link(2), "../pre-2.log-shipper");
        assert_eq!(l.manifest(), "manifest.log-shipper.json");
        let all = [
            a.pre_dir(1),
            a.final_dir(),
            a.manifest(),
            l.pre_dir(1),
            l.final_dir(),
            l.manifest(),
        ];
        for d in &all {
            assert!(check_image_path(&format!("{d}/pages-1.img")).is_ok(), "{d}");
        }
        let mut unique = all.to_vec();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), all.len(), "two containers share a name");
        // The stream sends rounds, then final dumps, then manifests: its sort keys
        // look at these prefixes.
        assert!(l.final_dir().starts_with("final") && l.manifest().starts_with("manifest"));
        assert!(l.pre_dir(7).starts_with("pre-7"));
    }

    #[test]
    fn bad_names_and_lists_are_invalid_arguments() {
        let cases: Vec<PrepareRequest> = vec![
            PrepareRequest::default(),
            named(&[("", "containerd://a")]),
            named(&[("App", "containerd://a")]),
            named(&[("a/b", "containerd://a")]),
            named(&[("..", "containerd://a")]),
            named(&[("-a", "containerd://a")]),
            named(&[("a.b", "containerd://a")]),
            named(&[(&"a".repeat(64), "containerd://a")]),
            named(&[("app", "containerd://a"), ("app", "containerd://b")]),
            named(&[("app", "")]),
            named(
                &(0..=MAX_CONTAINERS)
                    .map(|_| ("c", "containerd://x"))
                    .collect::<Vec<_>>(),
            ),
        ];
        for r in cases {
            let e = PodPlan::from_request(&r).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{r:?}: {e}");
        }
        let most: Vec<(String, String)> = (0..MAX_CONTAINERS)
            .map(|i| (format!("c{i}"), format!("containerd://{i}")))
            .collect();
        let r = named(
            &most
                .iter()
                .map(|(n, i)| (n.as_str(), i.as_str()))
                .collect::<Vec<_>>(),
        );
        assert_eq!(
            PodPlan::from_request(&r).unwrap().containers().len(),
            MAX_CONTAINERS
        );
    }
}
