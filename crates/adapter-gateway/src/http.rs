//! The HTTP adapter. A request is `POST {base}/v1/{operation}` with the request identity as
//! `Idempotency-Key`; a status query is `GET {base}/v1/requests/{identity}`.
//!
//! The mapping is deliberately conservative: only a definite answer is known. Anything that
//! may have reached the service without an answer (timeout, reset, 5xx, a 409 for a request
//! still in flight) is *unknown*.

use std::time::{Duration, SystemTime};

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

/// `Retry-After` as a number of seconds or as an HTTP date (RFC 9110 §10.2.3), a date read
/// against `now`: one already past asks for no wait. 1 s when absent or neither.
fn retry_after(value: Option<&str>, now: SystemTime) -> Duration {
    let Some(v) = value.map(str::trim) else {
        return DEFAULT_RETRY_AFTER;
    };
    if let Ok(seconds) = v.parse::<u64>() {
        return Duration::from_secs(seconds);
    }
    match httpdate::parse_http_date(v) {
        Ok(at) => at.duration_since(now).unwrap_or(Duration::ZERO),
        Err(_) => DEFAULT_RETRY_AFTER,
    }
}

/// What an answer's status settles before its body is read: a rate limit (with its
/// `Retry-After`), or a status that may hide an effect (5xx; a `409` for a keyed request
/// whose twin is still being processed). `None`: the body decides.
fn settled_by_status(status: u16, retry_after_header: Option<&str>) -> Option<CallOutcome> {
    if status == 429 {
        return Some(CallOutcome::RateLimited {
            retry_after: retry_after(retry_after_header, SystemTime::now()),
        });
    }
    if (500..600).contains(&status) {
        return Some(CallOutcome::Unknown {
            reason: format!("server answered {status}"),
        });
    }
    // 409 to a keyed request: one with the same key is still being processed (the IETF
    // Idempotency-Key draft; Stripe answers so). Its effect may yet commit, so this is "ask
    // again later with the same key", never a refusal.
    if status == 409 && !z29c_store::faults::broken(z29c_store::faults::Break::ConflictRefused) {
        return Some(CallOutcome::Unknown {
            reason: "409 Conflict: a request with this idempotency key is still in flight".into(),
        });
    }
    None
}

/// What an answer establishes from its status and body (or why the body could not be read):
/// a success names its reference, or it proves nothing; another status is a refusal.
fn settled_by_body(status: u16, body: Result<String, String>) -> CallOutcome {
    let text = match body {
        Ok(t) => t,
        Err(reason) => return CallOutcome::Unknown { reason },
    };
    let result: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    if (200..300).contains(&status) {
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
            status,
            reason: result
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("rejected")
                .to_owned(),
        }
    }
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
    let status = resp.status().as_u16();
    let header = resp
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok());
    if let Some(outcome) = settled_by_status(status, header) {
        return outcome;
    }
    settled_by_body(status, read_bounded(resp).await)
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
    match query_settled_by_status(resp.status().as_u16()) {
        Some(outcome) => outcome,
        None => query_settled_by_body(read_bounded(resp).await),
    }
}

/// What a status query's status settles: "no such request" (404), "still being processed"
/// (202, 409: not an answer yet, and not a "no"), anything but 200 (unknown). `None`: a 200,
/// whose body decides.
fn query_settled_by_status(status: u16) -> Option<QueryOutcome> {
    match status {
        200 => None,
        404 => Some(QueryOutcome::NotFound),
        // the broken build that takes "still being processed" for "never received"
        202 | 409
            if z29c_store::faults::broken(z29c_store::faults::Break::InProgressAsNotFound) =>
        {
            Some(QueryOutcome::NotFound)
        }
        202 | 409 => Some(QueryOutcome::Unknown {
            reason: "the destination is still processing the request".into(),
        }),
        other => Some(QueryOutcome::Unknown {
            reason: format!("status query answered {other}"),
        }),
    }
}

/// A 200 status answer: the effect, if it names its reference.
fn query_settled_by_body(body: Result<String, String>) -> QueryOutcome {
    match body.and_then(|t| serde_json::from_str::<Value>(&t).map_err(|e| e.to_string())) {
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
    }
}

#[cfg(test)]
mod tests {
    //! Every status an adapter may answer, mapped without a server: only a definite answer is
    //! known, and nothing that may hide an effect is ever a refusal.

    use super::*;

    fn unknown(o: &CallOutcome) -> bool {
        matches!(o, CallOutcome::Unknown { .. })
    }

    #[test]
    fn a_rate_limit_waits_its_retry_after_or_a_second() {
        let cases = [
            (Some("3"), 3_000),
            (Some(" 10 "), 10_000),
            (None, 1_000),
            (Some("soon"), 1_000),
            (Some("-1"), 1_000),
        ];
        for (header, ms) in cases {
            assert_eq!(
                settled_by_status(429, header),
                Some(CallOutcome::RateLimited {
                    retry_after: Duration::from_millis(ms)
                }),
                "{header:?}"
            );
        }
    }

    #[test]
    fn a_retry_after_may_be_an_http_date() {
        let now = httpdate::parse_http_date("Sun, 06 Dec 2026 10:00:00 GMT").unwrap();
        let cases = [
            (Some("Sun, 06 Dec 2026 10:00:30 GMT"), 30_000),
            (Some("Sun, 06 Dec 2026 11:00:00 GMT"), 3_600_000),
            // already past: no wait
            (Some("Sun, 06 Dec 2026 09:59:00 GMT"), 0),
            (Some("Sunday, 06-Dec-26 10:00:05 GMT"), 5_000),
            (Some("Sun Dec  6 10:00:07 2026"), 7_000),
            (Some("Sun, 06 Dec 2026 25:00:00 GMT"), 1_000),
            (Some("120"), 120_000),
        ];
        for (header, ms) in cases {
            assert_eq!(
                retry_after(header, now),
                Duration::from_millis(ms),
                "{header:?}"
            );
        }
    }

    #[test]
    fn a_server_error_or_a_conflict_in_flight_is_unknown_never_a_refusal() {
        for status in [409, 500, 502, 503, 504, 599] {
            let o = settled_by_status(status, None).expect("settled by its status");
            assert!(unknown(&o), "{status}: {o:?}");
        }
    }

    #[test]
    fn other_statuses_leave_it_to_the_body() {
        for status in [
            200, 201, 202, 204, 301, 400, 401, 403, 404, 408, 410, 422, 425,
        ] {
            assert_eq!(settled_by_status(status, Some("5")), None, "{status}");
        }
    }

    #[test]
    fn a_success_counts_only_with_its_reference() {
        let body = |s: &str| Ok(s.to_owned());
        for status in [200, 201] {
            assert_eq!(
                settled_by_body(status, body(r#"{"reference":"r-1","x":2}"#)),
                CallOutcome::Succeeded {
                    reference: "r-1".into(),
                    result: serde_json::json!({"reference": "r-1", "x": 2}),
                }
            );
        }
        for (status, text) in [
            (200, r#"{"reference":""}"#),
            (200, r#"{}"#),
            (200, "ok"),
            (202, r#"{"status":"accepted"}"#),
            (204, ""),
        ] {
            let o = settled_by_body(status, body(text));
            assert!(unknown(&o), "{status} {text}: {o:?}");
        }
    }

    #[test]
    fn a_body_lost_or_too_large_is_unknown_whatever_the_status() {
        for status in [200, 201, 400] {
            let o = settled_by_body(status, Err("answer lost while reading".into()));
            assert!(unknown(&o), "{status}: {o:?}");
        }
    }

    #[test]
    fn a_client_error_is_a_refusal_with_its_reason() {
        assert_eq!(
            settled_by_body(400, Ok(r#"{"error":"card declined"}"#.into())),
            CallOutcome::Rejected {
                status: 400,
                reason: "card declined".into()
            }
        );
        assert_eq!(
            settled_by_body(422, Ok("not json".into())),
            CallOutcome::Rejected {
                status: 422,
                reason: "rejected".into()
            }
        );
    }

    #[test]
    fn a_status_query_says_no_only_with_a_404() {
        assert_eq!(query_settled_by_status(404), Some(QueryOutcome::NotFound));
        assert_eq!(query_settled_by_status(200), None);
        for status in [202, 409, 400, 410, 429, 500, 503] {
            assert!(
                matches!(
                    query_settled_by_status(status),
                    Some(QueryOutcome::Unknown { .. })
                ),
                "{status}"
            );
        }
        assert_eq!(
            query_settled_by_body(Ok(r#"{"reference":"r-9"}"#.into())),
            QueryOutcome::Found {
                reference: "r-9".into(),
                result: serde_json::json!({"reference": "r-9"}),
            }
        );
        for body in [
            Ok("{}".to_owned()),
            Ok("r-9".to_owned()),
            Err("lost".to_owned()),
        ] {
            assert!(
                matches!(
                    query_settled_by_body(body.clone()),
                    QueryOutcome::Unknown { .. }
                ),
                "{body:?}"
            );
        }
    }
}
