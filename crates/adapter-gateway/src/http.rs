//! The HTTP adapter. A request is `POST {base}/v1/{operation}` with the request identity as
//! `Idempotency-Key`; a status query is `GET {base}/v1/requests/{identity}`.
//!
//! The mapping is deliberately conservative: only a definite answer is known. Anything that
//! may have reached the service without an answer (timeout, reset, 5xx, a 409 for a request
//! still in flight) is *unknown*.

use std::time::Duration;

use serde_json::Value;

/// What one call established.
#[derive(Debug, Clone, PartialEq)]
pub enum CallOutcome {
    Succeeded {
        reference: String,
        result: Value,
    },
    /// A definite refusal (4xx other than 429): the effect did not happen.
    Rejected {
        status: u16,
        reason: String,
    },
    RateLimited {
        retry_after: Duration,
    },
    /// The request never left (connection refused): nothing happened, try later.
    NotSent {
        reason: String,
    },
    /// The request may have been accepted; nobody knows.
    Unknown {
        reason: String,
    },
}

/// What a status query established.
#[derive(Debug, Clone, PartialEq)]
pub enum QueryOutcome {
    Found { reference: String, result: Value },
    NotFound,
    Unknown { reason: String },
}

const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Largest answer read from an adapter. A bigger one may still mean the effect happened, so
/// it is *unknown*, not an error: recovery decides.
pub const MAX_ANSWER_BYTES: usize = 256 * 1024;

/// The body, or why it could not be had: lost mid-read, or larger than [`MAX_ANSWER_BYTES`].
async fn read_bounded(mut resp: reqwest::Response) -> Result<String, String> {
    let mut body = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > MAX_ANSWER_BYTES {
                    return Err(format!("answer larger than {MAX_ANSWER_BYTES} bytes"));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(String::from_utf8_lossy(&body).into_owned()),
            Err(e) => return Err(format!("answer lost while reading: {e}")),
        }
    }
}

fn retry_after(resp: &reqwest::Response) -> Duration {
    resp.headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_RETRY_AFTER, Duration::from_secs)
}

pub async fn invoke(
    client: &reqwest::Client,
    base_url: &str,
    operation: &str,
    key: &str,
    body: &Value,
    timeout: Duration,
) -> CallOutcome {
    let url = format!("{}/v1/{operation}", base_url.trim_end_matches('/'));
    let sent = client
        .post(url)
        .header("Idempotency-Key", key)
        .json(body)
        .timeout(timeout)
        .send()
        .await;
    let resp = match sent {
        Ok(resp) => resp,
        Err(e) if e.is_connect() => {
            return CallOutcome::NotSent {
                reason: e.to_string(),
            };
        }
        Err(e) => {
            return CallOutcome::Unknown {
                reason: if e.is_timeout() {
                    format!("no answer within {} ms", timeout.as_millis())
                } else {
                    e.to_string()
                },
            };
        }
    };
    let status = resp.status();
    if status.as_u16() == 429 {
        return CallOutcome::RateLimited {
            retry_after: retry_after(&resp),
        };
    }
    if status.is_server_error() {
        return CallOutcome::Unknown {
            reason: format!("server answered {status}"),
        };
    }
    // 409 to a keyed request: one with the same key is still being processed (the IETF
    // Idempotency-Key draft; Stripe answers so). Its effect may yet commit, so this is "ask
    // again later with the same key", never a refusal.
    if status == reqwest::StatusCode::CONFLICT
        && !z29c_store::faults::broken(z29c_store::faults::Break::ConflictRefused)
    {
        return CallOutcome::Unknown {
            reason: "409 Conflict: a request with this idempotency key is still in flight".into(),
        };
    }
    let text = match read_bounded(resp).await {
        Ok(t) => t,
        Err(reason) => return CallOutcome::Unknown { reason },
    };
    let result: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    if status.is_success() {
        match result.get("reference").and_then(Value::as_str) {
            Some(reference) if !reference.is_empty() => CallOutcome::Succeeded {
                reference: reference.to_owned(),
                result,
            },
            _ => CallOutcome::Unknown {
                reason: "success without a reference".into(),
            },
        }
    } else {
        CallOutcome::Rejected {
            status: status.as_u16(),
            reason: result
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("rejected")
                .to_owned(),
        }
    }
}

pub async fn query(
    client: &reqwest::Client,
    base_url: &str,
    key: &str,
    timeout: Duration,
) -> QueryOutcome {
    let url = format!("{}/v1/requests/{key}", base_url.trim_end_matches('/'));
    let resp = match client.get(url).timeout(timeout).send().await {
        Ok(r) => r,
        Err(e) => {
            return QueryOutcome::Unknown {
                reason: e.to_string(),
            };
        }
    };
    match resp.status().as_u16() {
        404 => QueryOutcome::NotFound,
        // the broken build that takes "still being processed" for "never received"
        202 | 409
            if z29c_store::faults::broken(z29c_store::faults::Break::InProgressAsNotFound) =>
        {
            QueryOutcome::NotFound
        }
        // received and still being processed: not an answer yet, and not a "no"
        202 | 409 => QueryOutcome::Unknown {
            reason: "the destination is still processing the request".into(),
        },
        200 => match read_bounded(resp)
            .await
            .and_then(|t| serde_json::from_str::<Value>(&t).map_err(|e| e.to_string()))
        {
            Ok(v) => match v.get("reference").and_then(Value::as_str) {
                Some(r) => QueryOutcome::Found {
                    reference: r.to_owned(),
                    result: v.clone(),
                },
                None => QueryOutcome::Unknown {
                    reason: "status without a reference".into(),
                },
            },
            Err(reason) => QueryOutcome::Unknown { reason },
        },
        other => QueryOutcome::Unknown {
            reason: format!("status query answered {other}"),
        },
    }
}
