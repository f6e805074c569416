//! Checking a NATS envelope before anything acts on it. A message is untrusted input: it may be
//! garbage, a body of another topic, an id that is not an id, or text that is not UTF-8
//! (refused by decoding itself). Each refusal names what was wrong.

use prost::Message;
use z29c_core::{StepId, WorkflowId};

use crate::v1::Envelope;
use crate::v1::envelope::Body;

/// The longest `msg_id` accepted (the outbox makes UUIDs; 200 leaves room, nothing more).
pub const MAX_MSG_ID: usize = 200;

/// Decodes and checks an envelope.
pub fn decode(payload: &[u8]) -> Result<Envelope, String> {
    let envelope = Envelope::decode(payload).map_err(|e| format!("not an envelope: {e}"))?;
    check(&envelope)?;
    Ok(envelope)
}

/// Refuses an envelope without a usable `msg_id` or body, or whose ids do not parse.
pub fn check(e: &Envelope) -> Result<(), String> {
    if e.msg_id.is_empty() || e.msg_id.len() > MAX_MSG_ID {
        return Err(format!("msg_id: needs 1 to {MAX_MSG_ID} bytes"));
    }
    if e.msg_id.chars().any(char::is_control) {
        return Err("msg_id: control characters".into());
    }
    let workflow = |id: &str| {
        id.parse::<WorkflowId>()
            .map(|_| ())
            .map_err(|err| format!("workflow_id: {}", err.reason))
    };
    let step = |id: &str| {
        id.parse::<StepId>()
            .map(|_| ())
            .map_err(|err| format!("step_id: {}", err.reason))
    };
    match e.body.as_ref().ok_or("no body")? {
        Body::StepReady(b) => {
            workflow(&b.workflow_id)?;
            step(&b.step_id)
        }
        Body::StepCompleted(b) => {
            workflow(&b.workflow_id)?;
            step(&b.step_id)
        }
        Body::LateEvidence(b) => {
            workflow(&b.workflow_id)?;
            step(&b.step_id)
        }
        Body::WorkflowChanged(b) => workflow(&b.workflow_id),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::StepReady;

    fn ready(workflow: &str, step: &str) -> Envelope {
        Envelope {
            msg_id: "m-1".into(),
            created_at: None,
            body: Some(Body::StepReady(StepReady {
                workflow_id: workflow.into(),
                step_id: step.into(),
            })),
        }
    }

    #[test]
    fn a_good_envelope_round_trips() {
        let (w, s) = (WorkflowId::new().to_string(), StepId::new().to_string());
        let e = ready(&w, &s);
        assert_eq!(decode(&e.encode_to_vec()).unwrap(), e);
    }

    #[test]
    fn garbage_bad_ids_no_body_and_bad_msg_ids_are_refused_with_a_reason() {
        assert!(
            decode(b"\xff\xff\xff")
                .unwrap_err()
                .starts_with("not an envelope")
        );
        let s = StepId::new().to_string();
        let e = ready("'; DROP TABLE steps; --", &s);
        assert!(
            decode(&e.encode_to_vec())
                .unwrap_err()
                .starts_with("workflow_id")
        );
        let mut e = ready(&WorkflowId::new().to_string(), &s);
        e.body = None;
        assert_eq!(check(&e).unwrap_err(), "no body");
        let mut e = ready(&WorkflowId::new().to_string(), &s);
        e.msg_id = "x".repeat(MAX_MSG_ID + 1);
        assert!(check(&e).unwrap_err().starts_with("msg_id"));
        e.msg_id = "a\u{0}b".into();
        assert!(check(&e).unwrap_err().starts_with("msg_id"));
    }

    #[test]
    fn invalid_utf8_in_a_string_field_is_refused_by_decoding() {
        // field 1 (msg_id), wire type 2, length 2, bytes that are not UTF-8
        let bytes = [0x0a, 0x02, 0xc3, 0x28];
        assert!(decode(&bytes).unwrap_err().starts_with("not an envelope"));
    }
}
