//! The platform PodMotion's own images are built for (`hack/images.sh`: Linux, one CPU
//! architecture), as the operator's setting (`--node-arch`, chart value
//! `global.nodeArch`): the nodeSelector keys of every pod the operator renders that runs
//! one of those images (the attachment Jobs, the RunnerPool preflight), and whether a
//! node can run them at all. The chart's `podmotion.nodeSelector` helper gives its own
//! pods the same keys.

use std::collections::BTreeMap;
use std::fmt;

/// The well-known node label of the operating system (set by every kubelet).
pub const OS_LABEL: &str = "kubernetes.io/os";
/// The well-known node label of the CPU architecture (set by every kubelet).
pub const ARCH_LABEL: &str = "kubernetes.io/arch";
/// The only operating system PodMotion's images run on.
pub const LINUX: &str = "linux";
/// The architecture the images are built for unless the installer says otherwise.
pub const DEFAULT_ARCH: &str = "amd64";

/// Linux, and one CPU architecture or any.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Platform {
    arch: Option<String>,
}

impl Default for Platform {
    fn default() -> Self {
        Platform::linux(DEFAULT_ARCH)
    }
}

impl Platform {
    /// Linux on `arch`; an empty `arch` is any architecture (multi-architecture images).
    pub fn linux(arch: &str) -> Platform {
        let arch = arch.trim();
        Platform {
            arch: (!arch.is_empty()).then(|| arch.to_string()),
        }
    }

    /// The architecture, when the images are built for one.
    pub fn arch(&self) -> Option<&str> {
        self.arch.as_deref()
    }

    /// The nodeSelector keys: `kubernetes.io/os: linux`, and `kubernetes.io/arch` when
    /// the images are built for one architecture.
    pub fn node_selector(&self) -> BTreeMap<String, String> {
        let mut sel = BTreeMap::from([(OS_LABEL.to_string(), LINUX.to_string())]);
        if let Some(arch) = &self.arch {
            sel.insert(ARCH_LABEL.to_string(), arch.clone());
        }
        sel
    }

    /// Why a node with `labels` cannot run the images: a platform label of the node
    /// that names another value (`None`: it can, as far as its labels tell). A label
    /// the node lacks is not held against it: every kubelet sets both, so only a node
    /// nobody runs (a simulated one) lacks them, and the pod's own nodeSelector still
    /// decides there.
    pub fn mismatch(&self, labels: &BTreeMap<String, String>) -> Option<String> {
        let clashes: Vec<String> = self
            .node_selector()
            .into_iter()
            .filter_map(|(k, want)| {
                let have = labels.get(&k)?;
                (*have != want).then(|| format!("{k}={have}"))
            })
            .collect();
        (!clashes.is_empty()).then(|| {
            format!(
                "the node is {}; PodMotion's images are built for {self} (the operator's \
                 --node-arch, chart value global.nodeArch)",
                clashes.join(", ")
            )
        })
    }

    /// `own` with the platform's keys added: `own`'s keys win where both name one, as
    /// in the chart's `podmotion.nodeSelector`. Returns the merged selector and every
    /// key `own` sets to another value than the platform's (`key`, own value,
    /// platform's value), so that a caller can say so instead of failing silently.
    pub fn merge(&self, own: &BTreeMap<String, String>) -> (BTreeMap<String, String>, Vec<Clash>) {
        let mut merged = self.node_selector();
        let clashes = own
            .iter()
            .filter_map(|(k, v)| {
                let platform = merged.get(k).filter(|p| *p != v)?;
                Some(Clash {
                    key: k.clone(),
                    own: v.clone(),
                    platform: platform.clone(),
                })
            })
            .collect();
        merged.extend(own.iter().map(|(k, v)| (k.clone(), v.clone())));
        (merged, clashes)
    }
}

/// `linux/amd64`, or `linux (any architecture)`.
impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.arch {
            Some(arch) => write!(f, "{LINUX}/{arch}"),
            None => write!(f, "{LINUX} (any architecture)"),
        }
    }
}

/// A nodeSelector key a resource sets to another value than the platform's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Clash {
    pub key: String,
    pub own: String,
    pub platform: String,
}

impl fmt::Display for Clash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={} where PodMotion's images need {}={}",
            self.key, self.own, self.key, self.platform
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_default_is_linux_on_amd64_and_an_empty_arch_is_any() {
        assert_eq!(
            Platform::default().node_selector(),
            labels(&[(OS_LABEL, "linux"), (ARCH_LABEL, "amd64")])
        );
        assert_eq!(Platform::default().to_string(), "linux/amd64");
        let any = Platform::linux("");
        assert_eq!(any.arch(), None);
        assert_eq!(any.node_selector(), labels(&[(OS_LABEL, "linux")]));
        assert_eq!(any.to_string(), "linux (any architecture)");
        assert_eq!(Platform::linux(" arm64 ").arch(), Some("arm64"));
    }

    #[test]
    fn a_node_of_another_os_or_arch_is_named_and_a_missing_label_is_not_held_against_it() {
        let p = Platform::default();
        let amd = labels(&[(OS_LABEL, "linux"), (ARCH_LABEL, "amd64")]);
        assert_eq!(p.mismatch(&amd), None);
        let arm = labels(&[(OS_LABEL, "linux"), (ARCH_LABEL, "arm64")]);
        let why = p.mismatch(&arm).expect("arm64 is not amd64");
        assert!(why.contains("kubernetes.io/arch=arm64"), "{why}");
        assert!(why.contains("linux/amd64"), "{why}");
        assert!(why.contains("global.nodeArch"), "{why}");
        let win = labels(&[(OS_LABEL, "windows"), (ARCH_LABEL, "amd64")]);
        let why = p.mismatch(&win).expect("windows is not linux");
        assert!(why.contains("kubernetes.io/os=windows"), "{why}");
        assert!(!why.contains("arch="), "{why}");
        assert_eq!(p.mismatch(&BTreeMap::new()), None);
        // Any architecture: only the OS counts.
        assert_eq!(Platform::linux("").mismatch(&arm), None);
        assert!(Platform::linux("").mismatch(&win).is_some());
    }

    #[test]
    fn merging_keeps_the_own_keys_and_names_each_clash() {
        let p = Platform::default();
        let (sel, clashes) = p.merge(&labels(&[("pool", "a")]));
        assert_eq!(
            sel,
            labels(&[("pool", "a"), (OS_LABEL, "linux"), (ARCH_LABEL, "amd64")])
        );
        assert!(clashes.is_empty());
        // The same value is no clash.
        let (_, clashes) = p.merge(&labels(&[(ARCH_LABEL, "amd64")]));
        assert!(clashes.is_empty());
        let (sel, clashes) = p.merge(&labels(&[(ARCH_LABEL, "arm64")]));
        assert_eq!(sel[ARCH_LABEL], "arm64", "the own key wins");
        assert_eq!(
            clashes,
            vec![Clash {
                key: ARCH_LABEL.into(),
                own: "arm64".into(),
                platform: "amd64".into()
            }]
        );
        assert_eq!(
            clashes[0].to_string(),
            "kubernetes.io/arch=arm64 where PodMotion's images need kubernetes.io/arch=amd64"
        );
        // Any architecture: an own arch is no clash.
        let (_, clashes) = Platform::linux("").merge(&labels(&[(ARCH_LABEL, "arm64")]));
        assert!(clashes.is_empty());
    }
}
