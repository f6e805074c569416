//! Who may do what: operator roles and the actions of the public services.
//!
//! A role grants its own actions and reading; roles do not nest otherwise, so a `resolver`
//! (who may declare that money moved) cannot submit, and an `operator` cannot resolve.

use crate::text_enum::text_enum;

text_enum! {
    /// A role carried in an operator's token.
    pub enum Role("role") {
        /// Reads workflows, steps, receipts and the review queue.
        Viewer = "viewer",
        /// Also submits and cancels workflows.
        Operator = "operator",
        /// Also resolves review items: declares what happened at the outside world.
        Resolver = "resolver",
    }
}

text_enum! {
    /// An action of `WorkflowService`, `ReviewService` or the console.
    pub enum Action("action") {
        Read = "read",
        Submit = "submit",
        Cancel = "cancel",
        Resolve = "resolve",
    }
}

impl Role {
    /// Whether this role alone allows `action`.
    pub const fn allows(self, action: Action) -> bool {
        matches!(
            (self, action),
            (_, Action::Read)
                | (Role::Operator, Action::Submit | Action::Cancel)
                | (Role::Resolver, Action::Resolve)
        )
    }
}

/// Whether any of `roles` allows `action`.
pub fn allowed(roles: &[Role], action: Action) -> bool {
    roles.iter().any(|r| r.allows(action))
}

impl Action {
    /// Whether the action changes state (and so is audited when allowed, not only when refused).
    pub const fn mutates(self) -> bool {
        !matches!(self, Action::Read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_and_action_has_its_answer() {
        let expected = |r: Role, a: Action| match (r, a) {
            (_, Action::Read) => true,
            (Role::Viewer, _) => false,
            (Role::Operator, Action::Submit | Action::Cancel) => true,
            (Role::Operator, Action::Resolve) => false,
            (Role::Resolver, Action::Resolve) => true,
            (Role::Resolver, _) => false,
        };
        for &r in Role::ALL {
            for &a in Action::ALL {
                assert_eq!(r.allows(a), expected(r, a), "{r} {a}");
            }
        }
    }

    #[test]
    fn no_roles_allow_nothing_and_roles_add_up() {
        for &a in Action::ALL {
            assert!(!allowed(&[], a), "{a}");
        }
        assert!(allowed(&[Role::Viewer, Role::Resolver], Action::Resolve));
        assert!(!allowed(&[Role::Viewer, Role::Resolver], Action::Submit));
        assert!(allowed(&[Role::Operator, Role::Resolver], Action::Cancel));
    }

    #[test]
    fn only_reading_is_not_a_mutation() {
        for &a in Action::ALL {
            assert_eq!(a.mutates(), a != Action::Read);
        }
    }

    #[test]
    fn roles_parse_by_name_and_refuse_others() {
        assert_eq!("resolver".parse::<Role>().unwrap(), Role::Resolver);
        assert!("admin".parse::<Role>().is_err());
        assert!("Viewer".parse::<Role>().is_err());
    }
}
