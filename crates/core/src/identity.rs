//! Which process may call which service: the role a certificate names, and the roles each
//! z29c server accepts.
//!
//! Every process of a deployment holds a certificate from the deployment's CA, so the CA alone
//! says only "one of ours". The certificate's role (a URI subject alternative name
//! `spiffe://z29c/<role>`) says which one, and each server accepts only the roles whose work
//! needs it: the adapter gateway sends requests to the outside world, so only executors and
//! recovery may call it, never an operator's or an application's certificate.

use crate::text_enum::text_enum;

/// What a certificate's URI SAN starts with; the role follows.
pub const ROLE_URI_PREFIX: &str = "spiffe://z29c/";

text_enum! {
    /// The role of a process, named in its certificate.
    pub enum ServiceRole("service role") {
        Scheduler = "scheduler",
        Executor = "executor",
        Recovery = "recovery",
        Gateway = "gateway",
        /// The web console, calling the scheduler and recovery for people signed in to it.
        Console = "console",
        /// A person's command line (`z29c submit`, `z29c review`, …).
        Operator = "operator",
        /// An application submitting and watching its workflows.
        Application = "application",
    }
}

text_enum! {
    /// A z29c server that checks its callers' roles.
    pub enum Server("server") {
        /// `WorkflowService` and the HTTP/JSON API, at the scheduler.
        Workflows = "workflows",
        /// `ReviewService`, at recovery.
        Reviews = "reviews",
        /// `AdapterGateway`: the one place requests leave for the outside world.
        Gateway = "gateway",
    }
}

impl ServiceRole {
    /// The URI SAN a certificate of this role carries.
    pub fn uri(self) -> String {
        format!("{ROLE_URI_PREFIX}{self}")
    }

    /// The role a URI SAN names, if it is a z29c role URI.
    pub fn from_uri(uri: &str) -> Option<Self> {
        uri.strip_prefix(ROLE_URI_PREFIX)?.parse().ok()
    }
}

impl Server {
    /// The roles whose certificates this server accepts.
    pub const fn callers(self) -> &'static [ServiceRole] {
        use ServiceRole as R;
        match self {
            Server::Workflows => &[R::Operator, R::Console, R::Application],
            Server::Reviews => &[R::Operator, R::Console],
            Server::Gateway => &[R::Executor, R::Recovery],
        }
    }

    /// Whether a certificate naming `roles` may call this server: one of them must be
    /// accepted.
    pub fn admits(self, roles: &[ServiceRole]) -> bool {
        roles.iter().any(|r| self.callers().contains(r))
    }

    /// What the server is called in a refusal.
    pub const fn title(self) -> &'static str {
        match self {
            Server::Workflows => "the workflow service",
            Server::Reviews => "the review service",
            Server::Gateway => "the adapter gateway",
        }
    }
}

/// Why a caller was refused, in words for the caller: what its certificate names, and what
/// the server accepts.
pub fn refusal(server: Server, roles: &[ServiceRole]) -> String {
    let accepted = server
        .callers()
        .iter()
        .map(|r| r.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let named = if roles.is_empty() {
        format!("names no z29c role (a URI SAN {ROLE_URI_PREFIX}<role>)")
    } else {
        format!(
            "names the role {}",
            roles
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    format!(
        "{} accepts only certificates of the roles {accepted}; the caller's certificate {named}",
        server.title()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_server_and_role_has_its_answer() {
        use ServiceRole as R;
        let expected = |s: Server, r: ServiceRole| match (s, r) {
            (Server::Gateway, R::Executor | R::Recovery) => true,
            (Server::Gateway, _) => false,
            (Server::Reviews, R::Operator | R::Console) => true,
            (Server::Reviews, _) => false,
            (Server::Workflows, R::Operator | R::Console | R::Application) => true,
            (Server::Workflows, _) => false,
        };
        for &s in Server::ALL {
            for &r in ServiceRole::ALL {
                assert_eq!(s.admits(&[r]), expected(s, r), "{s} {r}");
            }
            assert!(!s.admits(&[]), "{s} admits a certificate without a role");
        }
    }

    #[test]
    fn operators_never_reach_the_gateway() {
        for role in [
            ServiceRole::Operator,
            ServiceRole::Console,
            ServiceRole::Application,
        ] {
            assert!(!Server::Gateway.admits(&[role]), "{role}");
        }
        // one accepted role among others is enough
        assert!(Server::Gateway.admits(&[ServiceRole::Operator, ServiceRole::Executor]));
    }

    #[test]
    fn role_uris_round_trip_and_others_name_no_role() {
        for &r in ServiceRole::ALL {
            assert_eq!(ServiceRole::from_uri(&r.uri()), Some(r));
        }
        for other in [
            "spiffe://z29c/",
            "spiffe://z29c/admin",
            "spiffe://other/executor",
            "spiffe://z29c/executor/extra",
            "executor",
            "",
        ] {
            assert_eq!(ServiceRole::from_uri(other), None, "{other:?}");
        }
    }

    #[test]
    fn refusals_say_what_was_named_and_what_is_accepted() {
        let r = refusal(Server::Gateway, &[ServiceRole::Operator]);
        assert!(r.contains("the adapter gateway"), "{r}");
        assert!(r.contains("executor, recovery"), "{r}");
        assert!(r.contains("names the role operator"), "{r}");
        let r = refusal(Server::Reviews, &[]);
        assert!(r.contains("no z29c role"), "{r}");
        assert!(r.contains(ROLE_URI_PREFIX), "{r}");
    }
}
