//! What an adapter promises about repeated and lost requests. The recovery decision after an
//! ambiguous invocation depends on nothing else (docs/design.md §5, §6).

use crate::text_enum::text_enum;

text_enum! {
    /// An adapter's declared capability.
    pub enum AdapterCapability("adapter capability") {
        /// Honours a stable idempotency key: repeating a request with the same key yields one
        /// effect and the same answer.
        Idempotent = "idempotent",
        /// Answers a status query by request identity, but a repeated request may act twice.
        Queryable = "queryable",
        /// Neither: after an ambiguous invocation only a person can say what happened.
        Opaque = "opaque",
    }
}

impl AdapterCapability {
    /// Whether a second request with the same identity is safe.
    pub const fn safe_to_repeat(self) -> bool {
        matches!(self, Self::Idempotent)
    }
}

/// The operation class status queries take their permits in (an adapter's
/// `limits.status_query`, or its default limit), apart from its calls' classes; no step's
/// operation may take the name.
pub const STATUS_QUERY_CLASS: &str = "status_query";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_idempotent_adapters_are_safe_to_repeat() {
        for &c in AdapterCapability::ALL {
            assert_eq!(c.safe_to_repeat(), c == AdapterCapability::Idempotent);
        }
    }

    #[test]
    fn capability_names_round_trip() {
        for &c in AdapterCapability::ALL {
            assert_eq!(c.as_str().parse::<AdapterCapability>().unwrap(), c);
        }
    }
}
