//! A gateway binary with a custom adapter: an in-memory ledger that records one entry per
//! request identity. It shows the whole adapter API: implement [`Adapter`] (a call and a
//! status query, saying only what is known), mark the adapter `kind = "custom"` in the
//! gateway's file, and hand the implementation to [`z29c_adapter_gateway::run_with`]. The
//! gateway keeps the permit, *invocation began* under the step's lease, the recording of the
//! answer and the registration; the adapter never touches PostgreSQL.
//!
//! Run it as `custom-gateway --config examples/custom-gateway/gateway.toml` beside the rest of
//! z29c (`--dump-config` prints the configuration it would run with).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde_json::json;
use z29c_adapter_gateway::{Adapter, Adapters, CallOutcome, Inquiry, Invocation, QueryOutcome};

/// One entry per request identity: a repeated request finds its entry, a query says whether
/// it exists, so the adapter is honestly `queryable` (and would be `idempotent` too) for as
/// long as the process lives. Its entries are in memory: after a restart its "not found" would
/// be untrue, so a real ledger keeps them where they outlive the process.
#[derive(Debug, Default)]
pub struct Ledger {
    entries: Mutex<HashMap<String, String>>,
}

#[tonic::async_trait]
impl Adapter for Ledger {
    async fn invoke(&self, call: Invocation<'_>) -> CallOutcome {
        if call
            .input
            .get("amount")
            .and_then(|a| a.as_i64())
            .is_none_or(|a| a <= 0)
        {
            // a definite refusal: nothing was recorded
            return CallOutcome::Rejected {
                status: 422,
                reason: "amount must be a positive whole number".into(),
            };
        }
        let mut entries = self.entries.lock().expect("ledger");
        let n = entries.len() + 1;
        let reference = entries
            .entry(call.identity.to_owned())
            .or_insert_with(|| format!("led-{n}"))
            .clone();
        CallOutcome::Succeeded {
            result: json!({ "reference": reference, "operation": call.operation }),
            reference,
        }
    }

    async fn query(&self, ask: Inquiry<'_>) -> QueryOutcome {
        match self.entries.lock().expect("ledger").get(ask.identity) {
            Some(reference) => QueryOutcome::Found {
                reference: reference.clone(),
                result: json!({ "reference": reference }),
            },
            None => QueryOutcome::NotFound,
        }
    }
}

fn main() -> anyhow::Result<()> {
    z29c_runtime::service_main("custom-gateway", |config, shutdown| {
        let adapters: Adapters = HashMap::from([(
            "ledger".to_owned(),
            Arc::new(Ledger::default()) as Arc<dyn Adapter>,
        )]);
        z29c_adapter_gateway::run_with(config, adapters, shutdown, None)
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn call<'a>(identity: &'a str, input: &'a serde_json::Value) -> Invocation<'a> {
        Invocation {
            operation: "post",
            identity,
            input,
            timeout: Duration::from_secs(1),
        }
    }

    #[tokio::test]
    async fn a_repeated_request_finds_its_entry_and_a_query_says_what_exists() {
        let ledger = Ledger::default();
        let input = json!({ "amount": 5 });
        let first = ledger.invoke(call("z29c:w:a", &input)).await;
        let again = ledger.invoke(call("z29c:w:a", &input)).await;
        assert_eq!(first, again);
        assert!(matches!(&first, CallOutcome::Succeeded { reference, .. } if reference == "led-1"));
        let ask = |identity| Inquiry {
            identity,
            timeout: Duration::from_secs(1),
        };
        assert!(
            matches!(ledger.query(ask("z29c:w:a")).await, QueryOutcome::Found { reference, .. } if reference == "led-1")
        );
        assert_eq!(ledger.query(ask("z29c:w:b")).await, QueryOutcome::NotFound);
        let refused = ledger
            .invoke(call("z29c:w:c", &json!({ "amount": 0 })))
            .await;
        assert!(matches!(refused, CallOutcome::Rejected { status: 422, .. }));
        assert_eq!(ledger.query(ask("z29c:w:c")).await, QueryOutcome::NotFound);
    }

    #[test]
    fn the_example_configuration_is_one_the_gateway_accepts() {
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/gateway.toml");
        let config: z29c_adapter_gateway::GatewayConfig =
            z29c_runtime::load_config(Some(std::path::Path::new(file))).unwrap();
        assert_eq!(
            config.adapters[0].kind,
            z29c_adapter_gateway::AdapterKind::Custom
        );
        let built = z29c_adapter_gateway::adapter::build(
            &config,
            HashMap::from([(
                "ledger".to_owned(),
                Arc::new(Ledger::default()) as Arc<dyn Adapter>,
            )]),
        )
        .unwrap();
        assert!(built.contains_key("ledger"));
        // without its implementation the gateway refuses to start, naming the adapter
        let Err(e) = z29c_adapter_gateway::adapter::build(&config, Adapters::new()) else {
            panic!("a custom adapter without its implementation was accepted")
        };
        assert!(e.to_string().contains("\"ledger\" is custom"), "{e}");
    }
}
