//! CPU and memory as the checks count them: a pod's requests, a node's room, and the
//! Kubernetes quantities they are written in.

use k8s_openapi::api::core::v1::Pod;

/// CPU in millicores and memory in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpu_millis: u64,
    pub memory_bytes: u64,
}

impl Resources {
    pub fn plus(self, o: Resources) -> Resources {
        Resources {
            cpu_millis: self.cpu_millis.saturating_add(o.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_add(o.memory_bytes),
        }
    }
    pub(super) fn fits_within(self, free: Resources) -> bool {
        self.cpu_millis <= free.cpu_millis && self.memory_bytes <= free.memory_bytes
    }
}

/// Sum of a pod's container requests (limits stand in for missing requests, as the
/// API server defaults them), with init containers counted as their maximum.
pub fn pod_requests(pod: &Pod) -> Resources {
    let Some(spec) = &pod.spec else {
        return Resources::default();
    };
    let of = |c: &k8s_openapi::api::core::v1::Container| {
        let r = c.resources.clone().unwrap_or_default();
        let get = |name: &str, parse: fn(&str) -> Option<u64>| {
            r.requests
                .as_ref()
                .and_then(|m| m.get(name))
                .or_else(|| r.limits.as_ref().and_then(|m| m.get(name)))
                .and_then(|q| parse(&q.0))
                .unwrap_or(0)
        };
        Resources {
            cpu_millis: get("cpu", cpu_millis),
            memory_bytes: get("memory", bytes),
        }
    };
    let main = spec
        .containers
        .iter()
        .map(of)
        .fold(Resources::default(), Resources::plus);
    let init = spec
        .init_containers
        .iter()
        .flatten()
        .map(of)
        .fold(Resources::default(), |a, b| Resources {
            cpu_millis: a.cpu_millis.max(b.cpu_millis),
            memory_bytes: a.memory_bytes.max(b.memory_bytes),
        });
    Resources {
        cpu_millis: main.cpu_millis.max(init.cpu_millis),
        memory_bytes: main.memory_bytes.max(init.memory_bytes),
    }
}

/// A Kubernetes quantity in base units (`2`, `500m`, `1.5Gi`, `64M`, `1e3`).
pub fn quantity(s: &str) -> Option<f64> {
    let s = s.trim();
    let suffixes: [(&str, f64); 13] = [
        ("Ki", 1024f64),
        ("Mi", 1024f64.powi(2)),
        ("Gi", 1024f64.powi(3)),
        ("Ti", 1024f64.powi(4)),
        ("Pi", 1024f64.powi(5)),
        ("Ei", 1024f64.powi(6)),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    for (suffix, factor) in suffixes {
        if let Some(num) = s.strip_suffix(suffix) {
            return num
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|v| v * factor);
        }
    }
    s.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0)
}

pub(super) fn cpu_millis(s: &str) -> Option<u64> {
    quantity(s).map(|v| (v * 1000.0).ceil() as u64)
}

pub(super) fn bytes(s: &str) -> Option<u64> {
    quantity(s).map(|v| v.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_in_base_units() {
        assert_eq!(cpu_millis("500m"), Some(500));
        assert_eq!(cpu_millis("2"), Some(2000));
        assert_eq!(cpu_millis("0.25"), Some(250));
        assert_eq!(bytes("64Gi"), Some(64 << 30));
        assert_eq!(bytes("128M"), Some(128_000_000));
        assert_eq!(bytes("1e3"), Some(1000));
        assert_eq!(bytes("lots"), None);
        assert_eq!(bytes("-1"), None);
    }
}
