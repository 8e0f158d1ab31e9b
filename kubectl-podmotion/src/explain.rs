//! API errors said so a person can act on them: a 403 names the verb, the resource and
//! the namespace and what to ask for; a 404 of the pod says which pod is missing where;
//! a 404 of a PodMotion resource type says the chart is not installed. Pure: takes the
//! HTTP code and the server's message, not the client.

/// What the plugin was doing when the API server answered with an error.
#[derive(Clone, Copy, Debug)]
pub struct Attempt<'a> {
    /// Kubernetes verb: `get`, `list`, `watch`, `create`, `delete`.
    pub verb: &'a str,
    /// `resource.group` (`podmigrations.podmotion.io`) or a core resource (`pods`).
    pub resource: &'a str,
    /// `None`: cluster-wide (all namespaces).
    pub namespace: Option<&'a str>,
    /// The object's name, when there is one.
    pub name: Option<&'a str>,
}

impl Attempt<'_> {
    fn where_(&self) -> String {
        match self.namespace {
            Some(ns) => format!("in namespace {ns}"),
            None => "in all namespaces (cluster-wide)".to_string(),
        }
    }
}

/// One sentence for an API error of `code` with the server's `message`.
pub fn api_error(a: Attempt<'_>, code: u16, message: &str) -> String {
    let what = a
        .name
        .map(|n| format!("{} {n}", singular(a.resource)))
        .unwrap_or_else(|| a.resource.to_string());
    match code {
        401 => format!(
            "the API server did not accept your credentials (401): log in again or check your kubeconfig ({message})"
        ),
        403 => {
            let ns_flag = a
                .namespace
                .map(|ns| format!(" -n {ns}"))
                .unwrap_or_else(|| " -A".to_string());
            format!(
                "you may not {verb} {res} {where_}: ask your cluster administrator for a Role{binding} that grants `{verb}` on `{res}` (check with `kubectl auth can-i {verb} {res}{ns_flag}`)",
                verb = a.verb,
                res = a.resource,
                where_ = a.where_(),
                binding = if a.namespace.is_some() {
                    " (and RoleBinding)"
                } else {
                    " — a ClusterRole and ClusterRoleBinding for all namespaces"
                },
            )
        }
        404 if a.name.is_some() => format!("{what} not found {}", a.where_()),
        404 => format!(
            "the API server does not serve {}: is PodMotion installed in this cluster? (helm install the podmotion chart) ({message})",
            a.resource
        ),
        409 => format!(
            "{what} already exists {}: choose another name (--name)",
            a.where_()
        ),
        422 => format!("the API server rejected {what}: {message}"),
        _ => format!(
            "{verb} {what} {where_} failed ({code}): {message}",
            verb = a.verb,
            where_ = a.where_()
        ),
    }
}

/// `pods` -> `pod`, `podmigrations.podmotion.io` -> `podmigration`: how a person names
/// one object of the resource.
fn singular(resource: &str) -> &str {
    let plural = resource.split('.').next().unwrap_or(resource);
    plural.strip_suffix('s').unwrap_or(plural)
}

/// [`api_error`] for a kube client error; other errors (network, kubeconfig) as they are.
pub fn kube_error(a: Attempt<'_>, e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => api_error(a, s.code, &s.message),
        other => format!(
            "{} {} {}: {other}",
            a.verb,
            a.name.unwrap_or(a.resource),
            a.where_()
        ),
    }
}

/// The HTTP code of an API error, if it is one.
pub fn code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CREATE_PMIG: Attempt<'static> = Attempt {
        verb: "create",
        resource: "podmigrations.podmotion.io",
        namespace: Some("shop"),
        name: None,
    };

    #[test]
    fn forbidden_names_verb_resource_and_namespace() {
        let s = api_error(
            CREATE_PMIG,
            403,
            "podmigrations.podmotion.io is forbidden: …",
        );
        assert!(
            s.starts_with("you may not create podmigrations.podmotion.io in namespace shop: ask"),
            "{s}"
        );
        assert!(
            s.contains("kubectl auth can-i create podmigrations.podmotion.io -n shop"),
            "{s}"
        );
    }

    #[test]
    fn forbidden_cluster_wide_asks_for_a_cluster_role() {
        let s = api_error(
            Attempt {
                verb: "list",
                resource: "runnerpools.podmotion.io",
                namespace: None,
                name: None,
            },
            403,
            "",
        );
        assert!(
            s.starts_with("you may not list runnerpools.podmotion.io in all namespaces"),
            "{s}"
        );
        assert!(s.contains("ClusterRole"), "{s}");
        assert!(s.contains("can-i list runnerpools.podmotion.io -A"), "{s}");
    }

    #[test]
    fn a_missing_pod_is_named() {
        let s = api_error(
            Attempt {
                verb: "get",
                resource: "pods",
                namespace: Some("shop"),
                name: Some("web-0"),
            },
            404,
            "pods \"web-0\" not found",
        );
        assert_eq!(s, "pod web-0 not found in namespace shop");
    }

    #[test]
    fn a_missing_resource_type_points_at_the_chart() {
        let s = api_error(
            CREATE_PMIG,
            404,
            "the server could not find the requested resource",
        );
        assert!(s.contains("is PodMotion installed"), "{s}");
    }

    #[test]
    fn a_name_clash_suggests_another_name() {
        let s = api_error(
            Attempt {
                name: Some("web-0-abcde"),
                ..CREATE_PMIG
            },
            409,
            "exists",
        );
        assert_eq!(
            s,
            "podmigration web-0-abcde already exists in namespace shop: choose another name (--name)"
        );
    }
}
