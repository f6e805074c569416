//! Who may do what on NATS: one user per service role, identified by an NKey (the server holds
//! only its public key; the service holds the seed, from a file or a Secret), each allowed to
//! publish and subscribe only the subjects its work needs under the deployment's prefix.
//!
//! What this closes: without a key nobody connects; with a service's key nobody can purge or
//! delete a stream or consumer (no role may call those JetStream APIs), publish a hint but the
//! scheduler, register a gateway but a gateway, or publish JetStream's advisories (which
//! executors turn into poison-message records). No role may create a consumer but the
//! executors their own pull consumer, by its name and filter: a consumer of another name could
//! push its deliveries to a subject its creator may not publish to. The registry is read by
//! message lookups instead. Each role's replies come to an inbox of its own, so one service
//! cannot read another's answers. An `admin` key, for people and the `nats` CLI, may do
//! anything; no service holds it.
//!
//! [`server_config`] writes the `authorization` block a `nats-server` configuration includes;
//! `z29c nats-auth` writes it with fresh keys, and `z29c dev` and the test harness run on it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use z29c_core::identity::ServiceRole;

use crate::{Names, Topic};

/// The roles that connect to NATS.
pub const NATS_ROLES: [ServiceRole; 4] = [
    ServiceRole::Scheduler,
    ServiceRole::Executor,
    ServiceRole::Recovery,
    ServiceRole::Gateway,
];

/// How a service proves itself to NATS. No seed file: no authentication (a server without
/// users, on loopback); the URL may still carry a user and password.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NatsAuth {
    /// A file holding this service's NKey seed (`SU…`), as `z29c nats-auth` writes it.
    pub nkey_file: Option<PathBuf>,
}

impl NatsAuth {
    /// The seed, read from its file (none configured: none).
    pub fn seed(&self) -> anyhow::Result<Option<String>> {
        use anyhow::Context;
        let Some(path) = &self.nkey_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("nats_auth.nkey_file: cannot read {}", path.display()))?;
        let seed = text.trim().to_owned();
        nkeys::KeyPair::from_seed(&seed).map_err(|e| {
            anyhow::anyhow!(
                "nats_auth.nkey_file: {} holds no NKey seed: {e}",
                path.display()
            )
        })?;
        Ok(Some(seed))
    }
}

/// What one role may publish and subscribe to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permissions {
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
}

/// The inbox replies to `role` come to (`_INBOX_<prefix>_<role>.…`).
pub fn inbox_prefix(names: &Names, role: ServiceRole) -> String {
    format!("_INBOX_{}_{role}", names.prefix)
}

/// The subjects `role` needs, and nothing else.
pub fn permissions(names: &Names, role: ServiceRole) -> Permissions {
    let events = names.stream();
    let registry = names.registry_name();
    // every service makes sure both streams exist and reads them
    let mut publish: Vec<String> = [&events, &registry]
        .iter()
        .flat_map(|s| {
            [
                format!("$JS.API.STREAM.INFO.{s}"),
                format!("$JS.API.STREAM.CREATE.{s}"),
            ]
        })
        .collect();
    publish.push("$JS.API.INFO".into());
    let mut subscribe = vec![format!("{}.>", inbox_prefix(names, role))];
    // reading the gateway registry: its subjects, then each one's last message
    let read_registry = [format!("$JS.API.STREAM.MSG.GET.{registry}")];
    let durable = crate::EXECUTOR_CONSUMER;
    match role {
        ServiceRole::Scheduler => {
            publish.extend(Topic::ALL.iter().map(|t| names.subject(*t)));
            publish.extend(read_registry);
        }
        ServiceRole::Executor => {
            publish.extend([
                format!("$JS.API.CONSUMER.INFO.{events}.{durable}"),
                format!(
                    "$JS.API.CONSUMER.CREATE.{events}.{durable}.{}",
                    names.subject(Topic::StepReady)
                ),
                format!("$JS.API.CONSUMER.MSG.NEXT.{events}.{durable}"),
                format!("$JS.ACK.{events}.{durable}.>"),
            ]);
            publish.extend(read_registry);
            subscribe.push(format!(
                "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{events}.{durable}"
            ));
        }
        ServiceRole::Recovery => publish.extend(read_registry),
        ServiceRole::Gateway => {
            publish.push(format!("{}.registry.gateway.>", names.prefix));
            publish.extend(read_registry);
        }
        // the console, operators and applications do not use NATS
        ServiceRole::Console | ServiceRole::Operator | ServiceRole::Application => {
            return Permissions {
                publish: Vec::new(),
                subscribe: Vec::new(),
            };
        }
    }
    Permissions { publish, subscribe }
}

fn quoted(subjects: &[String]) -> String {
    subjects
        .iter()
        .map(|s| format!("{s:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The `authorization` block of a `nats-server` configuration: one user per `(role, public
/// NKey)`, with that role's [`permissions`] under `names`, and an `admin` user without limits
/// when its public key is given.
pub fn server_config(
    names: &Names,
    users: &[(ServiceRole, String)],
    admin: Option<&str>,
) -> String {
    let mut out = String::from(
        "# z29c's NATS users: one NKey per service role, each allowed only its own subjects.\n\
         authorization {\n  users = [\n",
    );
    if let Some(public) = admin {
        out.push_str(&format!(
            "    # admin: people and the nats CLI; no service holds this key\n    {{ nkey: {public:?} }}\n"
        ));
    }
    for (role, public) in users {
        let p = permissions(names, *role);
        out.push_str(&format!(
            "    # {role}\n    {{ nkey: {public:?}, permissions: {{\n      publish: {{ allow: [{}] }}\n      subscribe: {{ allow: [{}] }}\n    }} }}\n",
            quoted(&p.publish),
            quoted(&p.subscribe)
        ));
    }
    out.push_str("  ]\n}\n");
    out
}

/// Fresh keys for `roles` under `names`, written to `dir`: `<role>.nk` (the seed, readable by
/// its owner only) per role, with `admin` also [`ADMIN_SEED`] for people, and `auth.conf`
/// (the server's `authorization` block). Returns the path of `auth.conf`.
pub fn write_keys(
    dir: &Path,
    names: &Names,
    roles: &[ServiceRole],
    admin: bool,
) -> anyhow::Result<PathBuf> {
    use anyhow::Context;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let new_key = |path: PathBuf| -> anyhow::Result<String> {
        let key = nkeys::KeyPair::new_user();
        let seed = key
            .seed()
            .map_err(|e| anyhow::anyhow!("an NKey without a seed: {e}"))?;
        std::fs::write(&path, format!("{seed}\n"))
            .with_context(|| format!("write {}", path.display()))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        }
        Ok(key.public_key())
    };
    let mut users = Vec::new();
    for role in roles {
        users.push((*role, new_key(seed_path(dir, *role))?));
    }
    let admin = if admin {
        Some(new_key(dir.join(ADMIN_SEED))?)
    } else {
        None
    };
    let conf = dir.join("auth.conf");
    std::fs::write(&conf, server_config(names, &users, admin.as_deref()))
        .with_context(|| format!("write {}", conf.display()))?;
    Ok(conf)
}

/// The file [`write_keys`] puts the admin's seed in.
pub const ADMIN_SEED: &str = "admin.nk";

/// Where [`write_keys`] puts the seed of `role`.
pub fn seed_path(dir: &Path, role: ServiceRole) -> PathBuf {
    dir.join(format!("{role}.nk"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allows(patterns: &[String], subject: &str) -> bool {
        patterns.iter().any(|p| matches(p, subject))
    }

    /// NATS subject matching: `*` one token, `>` the rest.
    fn matches(pattern: &str, subject: &str) -> bool {
        let (mut p, mut s) = (pattern.split('.'), subject.split('.'));
        loop {
            match (p.next(), s.next()) {
                (Some(">"), Some(_)) => return true,
                (Some("*"), Some(_)) => {}
                (Some(a), Some(b)) if a == b => {}
                (None, None) => return true,
                _ => return false,
            }
        }
    }

    #[test]
    fn no_role_may_purge_delete_or_forge_advisories() {
        let n = Names::new("z29c").unwrap();
        for role in ServiceRole::ALL {
            let p = permissions(&n, *role);
            for forbidden in [
                "$JS.API.STREAM.PURGE.Z29C_EVENTS",
                "$JS.API.STREAM.PURGE.Z29C_REGISTRY",
                "$JS.API.STREAM.DELETE.Z29C_EVENTS",
                "$JS.API.STREAM.UPDATE.Z29C_EVENTS",
                "$JS.API.CONSUMER.DELETE.Z29C_EVENTS.executors",
                "$JS.API.STREAM.MSG.DELETE.Z29C_EVENTS",
                "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.Z29C_EVENTS.executors",
                "$JS.API.STREAM.CREATE.OTHER_EVENTS",
                "other.step.ready",
            ] {
                assert!(!allows(&p.publish, forbidden), "{role} may {forbidden}");
            }
        }
    }

    #[test]
    fn each_subject_has_only_its_publisher() {
        let n = Names::new("z29c").unwrap();
        let publishers = |subject: &str| -> Vec<ServiceRole> {
            ServiceRole::ALL
                .iter()
                .copied()
                .filter(|r| allows(&permissions(&n, *r).publish, subject))
                .collect()
        };
        for topic in Topic::ALL {
            assert_eq!(publishers(&n.subject(topic)), [ServiceRole::Scheduler]);
        }
        assert_eq!(
            publishers("z29c.registry.gateway.gw-1"),
            [ServiceRole::Gateway]
        );
        assert_eq!(
            publishers("$JS.API.CONSUMER.MSG.NEXT.Z29C_EVENTS.executors"),
            [ServiceRole::Executor]
        );
        assert_eq!(
            publishers("$JS.ACK.Z29C_EVENTS.executors.1.2.3.4.5"),
            [ServiceRole::Executor]
        );
        assert_eq!(
            publishers("$JS.API.CONSUMER.CREATE.Z29C_EVENTS.executors.z29c.step.ready"),
            [ServiceRole::Executor]
        );
        // the registry is read by every service that uses NATS, by message lookups
        assert_eq!(
            publishers("$JS.API.STREAM.MSG.GET.Z29C_REGISTRY"),
            NATS_ROLES
        );
        // a consumer of any other name, or on another subject, or on the registry: nobody
        for other in [
            "$JS.API.CONSUMER.CREATE.Z29C_EVENTS",
            "$JS.API.CONSUMER.CREATE.Z29C_EVENTS.pushy.z29c.step.ready",
            "$JS.API.CONSUMER.CREATE.Z29C_EVENTS.executors.z29c.workflow.changed",
            "$JS.API.CONSUMER.DURABLE.CREATE.Z29C_EVENTS.pushy",
            "$JS.API.CONSUMER.CREATE.Z29C_REGISTRY",
            "$JS.API.CONSUMER.CREATE.Z29C_REGISTRY.x.z29c.registry.gateway.>",
        ] {
            assert!(publishers(other).is_empty(), "{other}");
        }
    }

    #[test]
    fn replies_come_to_each_roles_own_inbox() {
        let n = Names::new("z29c").unwrap();
        for role in NATS_ROLES {
            let sub = permissions(&n, role).subscribe;
            assert!(allows(&sub, &format!("{}.abc", inbox_prefix(&n, role))));
            for other in NATS_ROLES.iter().filter(|r| **r != role) {
                assert!(
                    !allows(&sub, &format!("{}.abc", inbox_prefix(&n, *other))),
                    "{role} reads {other}'s replies"
                );
            }
            assert!(!allows(&sub, "_INBOX.abc"), "{role}");
            assert!(!allows(&sub, "z29c.step.ready"), "{role}");
        }
        for role in [ServiceRole::Console, ServiceRole::Operator] {
            assert!(permissions(&n, role).publish.is_empty());
        }
    }

    #[test]
    fn keys_and_config_are_written_and_seeds_read_back() {
        let dir = std::env::temp_dir().join(format!("z29c-nkeys-{}", std::process::id()));
        let n = Names::new("t1").unwrap();
        let without = write_keys(&dir, &n, &NATS_ROLES, false).unwrap();
        let text = std::fs::read_to_string(&without).unwrap();
        assert_eq!(text.matches("nkey: \"U").count(), 4, "{text}");
        assert!(!dir.join(ADMIN_SEED).exists());
        let conf = write_keys(&dir, &n, &NATS_ROLES, true).unwrap();
        let text = std::fs::read_to_string(&conf).unwrap();
        // four services and the admin
        assert_eq!(text.matches("nkey: \"U").count(), 5, "{text}");
        assert!(dir.join(ADMIN_SEED).exists());
        assert!(text.contains("\"$JS.API.STREAM.INFO.T1_EVENTS\""), "{text}");
        for role in NATS_ROLES {
            let auth = NatsAuth {
                nkey_file: Some(seed_path(&dir, role)),
            };
            let seed = auth.seed().unwrap().unwrap();
            let public = nkeys::KeyPair::from_seed(&seed).unwrap().public_key();
            assert!(text.contains(&public), "{role}");
        }
        std::fs::write(dir.join("bad.nk"), "not a seed").unwrap();
        let e = NatsAuth {
            nkey_file: Some(dir.join("bad.nk")),
        }
        .seed()
        .unwrap_err()
        .to_string();
        assert!(e.contains("nats_auth.nkey_file"), "{e}");
        assert_eq!(NatsAuth::default().seed().unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
