//! Results flowing to dependent steps, and the reasons a read gives, against real PostgreSQL.

mod common;

use common::*;
use serde_json::{Value, json};
use sqlx::PgPool;
use z29c_core::{ExternalReference, InputDigest, Outcome, ProductState, StepState, WorkflowState};
use z29c_store::leases::{ClaimedStep, Observed};
use z29c_store::workflows::{SubmitLimits, WorkflowFilter};
use z29c_store::{MIGRATOR, Store, StoreError};

fn answered(c: &ClaimedStep, reference: &str, result: Value) -> Observed {
    Observed {
        external_reference: Some(ExternalReference::parse(reference).unwrap()),
        result,
        ..success(c, reference)
    }
}

async fn claim_one(store: &Store) -> ClaimedStep {
    let mut claimed = store.claim(&owner("executor-1"), 1).await.unwrap();
    assert_eq!(claimed.len(), 1, "one step to claim");
    claimed.pop().unwrap()
}

/// `charge` refers to what `reserve` answered and `ship` to `charge`'s reference: each input
/// is resolved when its dependencies have succeeded, from their receipts, and the resolved
/// input (with its digest) is what the claim hands out and what the receipt is about.
#[sqlx::test(migrator = "MIGRATOR")]
async fn a_dependents_input_is_resolved_from_its_dependencies_receipts(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let mut charge = step("charge", &["reserve"]);
    charge.input = json!({ "reservation": "${steps.reserve.result/id}", "amount": 5 });
    let mut ship = step("ship", &["reserve", "charge"]);
    ship.input = json!({
        "payment": "${steps.charge.reference}",
        "lines": "${steps.reserve.result/lines}",
        "note": "order ${steps.reserve.result/id}, $${literal}"
    });
    let submitted = submit(
        &store,
        &workflow("flow-1", vec![step("reserve", &[]), charge, ship]),
    )
    .await;
    let answered_input = &submitted.detail.unwrap().steps[1].input;
    assert_eq!(
        answered_input["reservation"], "${steps.reserve.result/id}",
        "until it is resolved a step shows its input as submitted"
    );

    let reserve = claim_one(&store).await;
    invoke(&store, &reserve).await;
    store
        .commit_receipt(
            &reserve.lease,
            &answered(
                &reserve,
                "res_1",
                json!({ "id": "res_1", "lines": [{ "sku": "a" }] }),
            ),
        )
        .await
        .unwrap();
    let charge = claim_one(&store).await;
    let want = json!({ "reservation": "res_1", "amount": 5 });
    assert_eq!(charge.input, want);
    assert_eq!(charge.input_digest, InputDigest::of_json(&want));
    invoke(&store, &charge).await;
    store
        .commit_receipt(
            &charge.lease,
            &answered(&charge, "ch_7", json!({ "id": "ch_7" })),
        )
        .await
        .unwrap();
    let ship = claim_one(&store).await;
    assert_eq!(
        ship.input,
        json!({
            "payment": "ch_7",
            "lines": [{ "sku": "a" }],
            "note": "order res_1, ${literal}"
        })
    );
    invoke(&store, &ship).await;
    let receipt = store
        .commit_receipt(&ship.lease, &answered(&ship, "shp_1", json!({})))
        .await
        .unwrap();
    assert_eq!(receipt.input_digest, ship.input_digest.as_str());
    let read = store.workflow(submitted.workflow).await.unwrap();
    assert_eq!(read.state, WorkflowState::Completed);
    assert_eq!(
        read.steps[2].input, ship.input,
        "a read shows what was sent"
    );
    assert_eq!(read.steps[2].depends_on, ["reserve", "charge"]);
    let attempts: Vec<String> =
        sqlx::query_scalar("SELECT input_digest FROM attempts WHERE step_id = $1 ORDER BY number")
            .bind(ship.lease.step.as_uuid())
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(attempts, [ship.input_digest.as_str()]);
}

/// A reference to a field the upstream result does not have fails the step, saying which,
/// and fails its workflow; nothing is claimed for it.
#[sqlx::test(migrator = "MIGRATOR")]
async fn a_reference_to_a_missing_field_fails_the_step_with_the_reason(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let mut charge = step("charge", &["reserve"]);
    charge.input = json!({ "reservation": "${steps.reserve.result/id}" });
    let submitted = submit(
        &store,
        &workflow(
            "flow-2",
            vec![step("reserve", &[]), charge, step("after", &["charge"])],
        ),
    )
    .await;
    let reserve = claim_one(&store).await;
    invoke(&store, &reserve).await;
    store
        .commit_receipt(
            &reserve.lease,
            &answered(&reserve, "res_1", json!({ "reservation_id": "res_1" })),
        )
        .await
        .unwrap();
    assert!(
        store
            .claim(&owner("executor-1"), 5)
            .await
            .unwrap()
            .is_empty()
    );
    let read = store.workflow(submitted.workflow).await.unwrap();
    assert_eq!(read.state, WorkflowState::Failed);
    assert_eq!(read.steps[1].state, StepState::Failed);
    let reason = read.steps[1].reason.clone().unwrap();
    assert!(
        reason.starts_with("input: ${steps.reserve.result/id}: the result of step \"reserve\" has nothing at \"/id\""),
        "{reason}"
    );
    assert_eq!(read.steps[2].state, StepState::Cancelled);
    assert_eq!(
        read.reason.as_deref(),
        Some(format!("step charge: {reason}").as_str())
    );
}

/// References are checked at submit: one well formed, and to a step the referring step
/// depends on. Each refusal names the field and writes nothing.
#[sqlx::test(migrator = "MIGRATOR")]
async fn a_reference_outside_depends_on_or_malformed_is_refused_at_submit(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    for (input, field, says) in [
        (
            json!({ "a": ["${steps.other.result}"] }),
            "steps[1].input/a/0",
            "not in this step's depends_on",
        ),
        (
            json!({ "a": "${steps.reserve.result" }),
            "steps[1].input/a",
            "never closes",
        ),
        (
            json!("${steps.reserve.output}"),
            "steps[1].input",
            "not a reference",
        ),
    ] {
        let mut charge = step("charge", &["reserve"]);
        charge.input = input;
        let wf = workflow(
            "refused",
            vec![step("reserve", &[]), charge, step("other", &[])],
        );
        match store.submit_workflow(&wf, &SubmitLimits::default()).await {
            Err(StoreError::Invalid { field: f, reason }) => {
                assert_eq!(f, field);
                assert!(reason.contains(says), "{reason}");
            }
            other => panic!("{field}: {other:?}"),
        }
    }
    // a first step may not refer to anything
    let mut first = step("first", &[]);
    first.input = json!("${steps.first.result}");
    let r = store
        .submit_workflow(&workflow("self", vec![first]), &SubmitLimits::default())
        .await;
    assert!(matches!(r, Err(StoreError::Invalid { .. })), "{r:?}");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM workflows")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
}

/// A step refused by its API says so: the status in words, the API and its reason; its
/// workflow says which step failed.
#[sqlx::test(migrator = "MIGRATOR")]
async fn a_refused_step_and_its_workflow_say_why(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    let c = claimed_single(&store, "refused-1", "executor-1").await;
    invoke(&store, &c).await;
    store
        .commit_receipt(
            &c.lease,
            &Observed {
                outcome: Outcome::Failed,
                external_reference: None,
                result: json!({ "status": 401, "reason": "Invalid API Key provided" }),
                ..success(&c, "unused")
            },
        )
        .await
        .unwrap();
    let read = store.workflow(c.workflow).await.unwrap();
    assert_eq!(
        read.steps[0].reason.as_deref(),
        Some("refused: 401 Unauthorized from http: Invalid API Key provided")
    );
    assert_eq!(
        read.reason.as_deref(),
        Some("step only: refused: 401 Unauthorized from http: Invalid API Key provided")
    );
    assert_eq!(read.product_state(), ProductState::Failed);
}

/// A list keeps the product states, the name and the id or client key asked for, and pages
/// through the rest.
#[sqlx::test(migrator = "MIGRATOR")]
async fn a_list_filters_by_state_name_and_search_and_pages(pool: PgPool) {
    let store = Store::from_pool(pool.clone());
    for i in 0..5 {
        submit(
            &store,
            &workflow(&format!("list-{i}"), vec![step("a", &[])]),
        )
        .await;
    }
    let failed = claimed_single(&store, "list-failed", "executor-1").await;
    invoke(&store, &failed).await;
    store
        .commit_receipt(
            &failed.lease,
            &Observed {
                outcome: Outcome::Failed,
                external_reference: None,
                result: json!({ "status": 400, "reason": "bad" }),
                ..success(&failed, "unused")
            },
        )
        .await
        .unwrap();
    let list = |filter: WorkflowFilter, limit| {
        let store = store.clone();
        async move { store.list_workflows(limit, None, &filter).await.unwrap() }
    };
    let page = list(
        WorkflowFilter {
            states: vec![ProductState::Failed],
            ..Default::default()
        },
        10,
    )
    .await;
    assert_eq!(page.workflows.len(), 1);
    assert_eq!(page.workflows[0].id, failed.workflow);
    assert_eq!(page.next, None);
    let page = list(
        WorkflowFilter {
            states: vec![ProductState::Preparing],
            ..Default::default()
        },
        2,
    )
    .await;
    assert_eq!(page.workflows.len(), 2);
    let mut seen: Vec<_> = page.workflows.iter().map(|w| w.id).collect();
    let mut next = page.next;
    while let Some(before) = next {
        let p = store
            .list_workflows(
                2,
                Some(before),
                &WorkflowFilter {
                    states: vec![ProductState::Preparing],
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        seen.extend(p.workflows.iter().map(|w| w.id));
        next = p.next;
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 5, "every preparing workflow once");
    let by_key = list(
        WorkflowFilter {
            search: Some("list-3".into()),
            ..Default::default()
        },
        10,
    )
    .await;
    assert_eq!(by_key.workflows.len(), 1);
    assert_eq!(by_key.workflows[0].client_key, "list-3");
    let by_id = list(
        WorkflowFilter {
            search: Some(failed.workflow.to_string()),
            ..Default::default()
        },
        10,
    )
    .await;
    assert_eq!(by_id.workflows[0].id, failed.workflow);
    let by_name = list(
        WorkflowFilter {
            name: Some("test list-4".into()),
            ..Default::default()
        },
        10,
    )
    .await;
    assert_eq!(by_name.workflows.len(), 1);
    assert!(
        list(
            WorkflowFilter {
                name: Some("nobody".into()),
                ..Default::default()
            },
            10
        )
        .await
        .workflows
        .is_empty()
    );
}

/// A step in review whose dependent uses its result: resolving it as succeeded needs the
/// result the person found (refused without, changing nothing), and the dependent then sends
/// what that result holds.
#[sqlx::test(migrator = "MIGRATOR")]
async fn a_review_resolved_with_the_result_found_feeds_the_dependent(pool: PgPool) {
    use z29c_store::review::Resolution;
    let store = Store::from_pool(pool.clone());
    let mut charge = step("charge", &["reserve"]);
    charge.input = json!({ "reservation": "${steps.reserve.result/id}" });
    let submitted = submit(
        &store,
        &workflow("review-1", vec![step("reserve", &[]), charge]),
    )
    .await;
    let reserve = claim_one(&store).await;
    invoke(&store, &reserve).await;
    let item = sent_to_review(&store, &pool, &reserve).await;
    let succeeded = Resolution::Succeeded(ExternalReference::parse("res_9").unwrap());
    match store
        .resolve_review(item.id, item.version, "alice", "found it", &succeeded)
        .await
    {
        Err(StoreError::Invalid { field, reason }) => {
            assert_eq!(field, "result_json");
            assert!(reason.contains("${steps.reserve.result/id}"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    store
        .resolve_review_found(
            item.id,
            item.version,
            "alice",
            "found it in the stock system",
            &succeeded,
            Some(json!({ "id": "res_9" })),
        )
        .await
        .unwrap();
    let charge = claim_one(&store).await;
    assert_eq!(charge.input, json!({ "reservation": "res_9" }));
    let read = store.workflow(submitted.workflow).await.unwrap();
    assert_eq!(read.steps[0].state, StepState::Completed);
}
