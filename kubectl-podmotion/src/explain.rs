//! API errors said so a person can act on them: a 403 names the verb, the resource and
//! the namespace and what to ask for; a 404 of the pod says which pod is missing where;
//! a 404 of a PodMotion resource type says the chart is not installed. Pure: takes the
//! HTTP code and the server's message, not the client. A refused port-forward (the
//! API server answers the websocket upgrade with 403, which kube reports as a failed
//! protocol switch, not as an API error) is said the same way.

use kube::client::UpgradeConnectionError;

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

impl<'a> Attempt<'a> {
    /// The watch of `resource` in `namespace` (refused only as a whole, so no name).
    pub fn watch(resource: &'a str, namespace: &'a str) -> Self {
        Attempt {
            verb: "watch",
            resource,
            namespace: Some(namespace),
            name: None,
        }
    }

    fn where_(&self) -> String {
        match self.namespace {
            Some(ns) => format!("in namespace {ns}"),
            None => "in all namespaces (cluster-wide)".to_string(),
        }
    }
}

/// One sentence for an API error of `code` with the server's `message`.
/// The server's message is sanitised ([`crate::sanitize`]): it is the server's text.
pub fn api_error(a: Attempt<'_>, code: u16, message: &str) -> String {
    let message = &*crate::sanitize(message);
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
            // `can-i VERB pods/x` asks about the pod named x: a subresource is a flag.
            let can_i = match a.resource.split_once('/') {
                Some((res, sub)) => format!("{res} --subresource={sub}"),
                None => a.resource.to_string(),
            };
            format!(
                "you may not {verb} {res} {where_}: ask your cluster administrator for a Role{binding} that grants `{verb}` on `{res}` (check with `kubectl auth can-i {verb} {can_i}{ns_flag}`)",
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
        kube::Error::UpgradeConnection(UpgradeConnectionError::ProtocolSwitch(status)) => {
            api_error(
                a,
                status.as_u16(),
                &format!("the upgrade was answered {status}"),
            )
        }
        other => crate::sanitize(&format!(
            "{} {} {}: {other}",
            a.verb,
            a.name.unwrap_or(a.resource),
            a.where_()
        ))
        .into_owned(),
    }
}

/// The HTTP code of an API error (or of a refused upgrade), if it is one.
pub fn code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        kube::Error::UpgradeConnection(UpgradeConnectionError::ProtocolSwitch(s)) => {
            Some(s.as_u16())
        }
        _ => None,
    }
}

/// The sentence to end a watch with, when the watcher's error is a 403 (the user may
/// not list or watch what `a` names; retrying cannot help); `None` for errors the
/// watcher's backoff rides out.
pub fn watch_refused(a: Attempt<'_>, e: &kube::runtime::watcher::Error) -> Option<String> {
    use kube::runtime::watcher::Error as W;
    match e {
        W::InitialListFailed(k) | W::WatchStartFailed(k) | W::WatchFailed(k)
            if code(k) == Some(403) =>
        {
            Some(kube_error(a, k))
        }
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

    const PORT_FORWARD: Attempt<'static> = Attempt {
        verb: "create",
        resource: "pods/portforward",
        namespace: Some("pm-agents"),
        name: Some("naa-web-0-x7"),
    };

    #[test]
    fn a_refused_port_forward_names_the_subresource_and_the_can_i_line() {
        // What kube returns when the API server answers the websocket upgrade 403.
        let e = kube::Error::UpgradeConnection(UpgradeConnectionError::ProtocolSwitch(
            http::StatusCode::FORBIDDEN,
        ));
        assert_eq!(code(&e), Some(403));
        let s = kube_error(PORT_FORWARD, &e);
        assert!(
            s.starts_with("you may not create pods/portforward in namespace pm-agents: ask your cluster administrator for a Role (and RoleBinding) that grants `create` on `pods/portforward`"),
            "{s}"
        );
        assert!(
            s.contains("`kubectl auth can-i create pods --subresource=portforward -n pm-agents`"),
            "{s}"
        );
        // Other upgrade failures are not read as an HTTP code.
        let e =
            kube::Error::UpgradeConnection(UpgradeConnectionError::MissingUpgradeWebSocketHeader);
        assert_eq!(code(&e), None);
        assert!(
            kube_error(PORT_FORWARD, &e)
                .starts_with("create naa-web-0-x7 in namespace pm-agents: ")
        );
    }

    #[test]
    fn only_a_forbidden_watch_ends_the_wait() {
        use kube::runtime::watcher::Error as W;
        let forbidden = || {
            kube::Error::Api(
                kube::core::Status::failure("podmigrations.podmotion.io is forbidden", "Forbidden")
                    .with_code(403)
                    .boxed(),
            )
        };
        let a = Attempt {
            verb: "watch",
            ..CREATE_PMIG
        };
        for e in [
            W::InitialListFailed(forbidden()),
            W::WatchStartFailed(forbidden()),
            W::WatchFailed(forbidden()),
        ] {
            let s = watch_refused(a, &e).expect("a 403 ends the watch");
            assert!(
                s.starts_with("you may not watch podmigrations.podmotion.io in namespace shop"),
                "{s}"
            );
        }
        let gone = kube::Error::Api(
            kube::core::Status::failure("too old", "Expired")
                .with_code(410)
                .boxed(),
        );
        assert_eq!(watch_refused(a, &W::WatchFailed(gone)), None);
        assert_eq!(watch_refused(a, &W::NoResourceVersion), None);
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

    #[test]
    fn an_api_servers_message_reaches_the_terminal_without_its_controls() {
        let a = Attempt {
            verb: "get",
            resource: "podmigrations",
            name: Some("m"),
            namespace: Some("ns"),
        };
        let s = api_error(a, 500, "boom\x1b]0;owned\x07\r\x1b[2Kall good");
        assert!(!s.chars().any(char::is_control), "{s:?}");
        assert!(
            s.contains("boom\\x1b]0;owned\\x07\\x0d\\x1b[2Kall good"),
            "{s}"
        );
    }
}
