//! A three-step order against the mock APIs ([`crate::apis`]), each step using what the one
//! before it produced: reserve stock, charge the payment naming the reservation's id, ship
//! naming the payment's reference. The same order is submitted through every way into z29c
//! (the client library, the HTTP API, the CLI); [`check_carried`] reads the APIs' own records
//! to see that each request carried the upstream values.

use anyhow::{Result, ensure};
use serde_json::{Value, json};

use crate::apis::Apis;

/// The payments API's key, handed to the gateway in the environment as [`KEY_ENV`].
pub const KEY: &str = "sk_test_z29c_0rd3rK3yF0rTh3T3sts00000";
pub const KEY_ENV: &str = "Z29C_TEST_ORDER_KEY";

/// A gateway's `[[adapters]]` for the order: `inventory` and `payments` (idempotent, by
/// `Idempotency-Key`) and `carrier` (queryable, by its search).
pub fn gateway_toml(apis_url: &str) -> String {
    format!(
        r#"
[[adapters]]
name = "inventory"
version = "inventory/1"
base_url = "{apis_url}/inventory"
capability = "idempotent"
default_limit = 4
safety_window_ms = 5000
[adapters.http]
path = "/{{operation}}"
reference = "/id"

[[adapters]]
name = "payments"
version = "stripe/2026-01"
base_url = "{apis_url}/stripe"
capability = "idempotent"
default_limit = 4
safety_window_ms = 5000
[adapters.http]
path = "/v1/{{operation}}"
reference = "/id"
refusal_reason = "/error/message"
[adapters.http.headers]
Authorization = {{ env = "{KEY_ENV}", prefix = "Bearer " }}

[[adapters]]
name = "carrier"
version = "carrier/v3"
base_url = "{apis_url}/carrier"
capability = "queryable"
default_limit = 4
safety_window_ms = 5000
[adapters.http]
path = "/shipments"
idempotency_header = ""
identity_field = "customer_reference"
reference = "/id"
[adapters.http.query]
path = "/shipments?customer_reference={{identity}}"
found = {{ status = [200], reference = "/data/0/id", result = "/data/0" }}
not_found = [{{ status = [200], empty = "/data" }}]
"#
    )
}

/// The order as a workflow file's document (YAML's JSON subset): what `z29c submit` reads
/// and the HTTP API's `POST /v1/workflows` takes. `sku` tells orders apart in the APIs'
/// records.
pub fn document(client_key: &str, sku: &str) -> Value {
    json!({
        "client_key": client_key,
        "name": "order",
        "steps": [
            {
                "name": "reserve",
                "adapter": "inventory",
                "operation": "reservations",
                "input": { "sku": sku, "quantity": 1 }
            },
            {
                "name": "charge",
                "adapter": "payments",
                "operation": "charges",
                "input": {
                    "amount": 1999,
                    "currency": "eur",
                    "metadata": { "reservation": "${steps.reserve.result/id}" }
                },
                "depends_on": ["reserve"]
            },
            {
                "name": "ship",
                "adapter": "carrier",
                "operation": "shipments",
                "input": {
                    "sku": "${steps.reserve.result/sku}",
                    "payment": "${steps.charge.reference}",
                    "note": "order ${steps.reserve.result/id} paid by ${steps.charge.reference}"
                },
                "depends_on": ["reserve", "charge"]
            }
        ]
    })
}

/// Checks, in the APIs' own records, that the order for `sku` made one reservation, one
/// charge naming that reservation, and one shipment naming that charge.
pub fn check_carried(apis: &Apis, sku: &str) -> Result<()> {
    let reservations: Vec<_> = apis
        .effects("inventory")
        .into_iter()
        .filter(|e| e.body["sku"] == sku)
        .collect();
    ensure!(
        reservations.len() == 1,
        "one reservation for {sku}: {reservations:?}"
    );
    let reservation = &reservations[0].id;
    let charges: Vec<_> = apis
        .effects("stripe")
        .into_iter()
        .filter(|e| e.body["metadata"]["reservation"] == reservation.as_str())
        .collect();
    ensure!(
        charges.len() == 1,
        "one charge naming reservation {reservation}: {:?}",
        apis.effects("stripe")
    );
    let charge = &charges[0].id;
    let shipments: Vec<_> = apis
        .effects("carrier")
        .into_iter()
        .filter(|e| e.body["payment"] == charge.as_str())
        .collect();
    ensure!(
        shipments.len() == 1,
        "one shipment naming charge {charge}: {:?}",
        apis.effects("carrier")
    );
    let shipment = &shipments[0].body;
    ensure!(shipment["sku"] == sku, "{shipment}");
    ensure!(
        shipment["note"] == format!("order {reservation} paid by {charge}").as_str(),
        "{shipment}"
    );
    Ok(())
}
