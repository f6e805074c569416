//! The HTTP adapter, speaking each adapter's declared contract ([`crate::contract`]): by
//! default `POST {base}/v1/{operation}` with the request identity as `Idempotency-Key`, and a
//! status query `GET {base}/v1/requests/{identity}`.
//!
//! The mapping is deliberately conservative: only a definite answer is known. Anything that
//! may have reached the service without an answer (timeout, reset, 5xx, a 409 for a request
//! still in flight) is *unknown*.

use std::time::{Duration, SystemTime};

use reqwest::header::HeaderMap;

use serde_json::Value;

use crate::contract::{HttpContract, QueryContract, StatusMeaning, fill, reference_at};

/// What one call established.
#[derive(Debug, Clone, PartialEq)]
pub enum CallOutcome {
    Succeeded {
        reference: String,
        result: Value,
    },
    /// A definite refusal (a status the contract lists as refused; status 0: the request could
    /// not be built from the step's input, and nothing was sent): the effect did not happen.
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

/// What an answer's status settles before its body is read, by the adapter's contract: a rate
/// limit (with its `Retry-After`), a request still in flight or a status no rule names
/// (unknown: the effect may exist). `None`: the body decides (done, or refused).
fn settled_by_status(
    contract: &HttpContract,
    status: u16,
    retry_after_header: Option<&str>,
) -> Option<CallOutcome> {
    match contract.meaning(status) {
        StatusMeaning::RateLimited => Some(CallOutcome::RateLimited {
            retry_after: retry_after(retry_after_header, SystemTime::now()),
        }),
        // one with the same key is still being processed (the IETF Idempotency-Key draft;
        // Stripe answers 409 so): its effect may yet commit, so this is "ask again later with
        // the same key", never a refusal
        StatusMeaning::InFlight
            if !z29c_store::faults::broken(z29c_store::faults::Break::ConflictRefused) =>
        {
            Some(CallOutcome::Unknown {
                reason: format!("{status}: a request with this identity is still in flight"),
            })
        }
        StatusMeaning::InFlight | StatusMeaning::Done | StatusMeaning::Refused => None,
        StatusMeaning::Unmatched => Some(CallOutcome::Unknown {
            reason: format!("server answered {status}"),
        }),
    }
}

/// What an answer establishes from its status and body (or why the body could not be read): a
/// success names its reference where the contract says, or it proves nothing; a refusal says
/// why where the contract says.
fn settled_by_body(
    contract: &HttpContract,
    status: u16,
    body: Result<String, String>,
) -> CallOutcome {
    let text = match body {
        Ok(t) => t,
        Err(reason) => return CallOutcome::Unknown { reason },
    };
    let result: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    if contract.meaning(status) == StatusMeaning::Done {
        match reference_at(&result, &contract.reference) {
            Some(reference) => CallOutcome::Succeeded { reference, result },
            None => CallOutcome::Unknown {
                reason: format!("success without a reference at {:?}", contract.reference),
            },
        }
    } else {
        CallOutcome::Rejected {
            status,
            reason: result
                .pointer(&contract.refusal_reason)
                .and_then(Value::as_str)
                .unwrap_or("rejected")
                .to_owned(),
        }
    }
}

/// One call to an adapter's API.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    pub contract: &'a HttpContract,
    /// The contract's headers, secrets read.
    pub headers: &'a HeaderMap,
    pub base_url: &'a str,
    pub operation: &'a str,
    pub identity: &'a str,
    pub input: &'a Value,
    pub timeout: Duration,
}

pub async fn invoke(client: &reqwest::Client, call: Call<'_>) -> CallOutcome {
    let c = call.contract;
    let path = match fill(&c.path, call.operation, call.identity, call.input) {
        Ok(p) => p,
        // the step's input cannot make this request: nothing is sent, and no retry helps
        Err(reason) => {
            return CallOutcome::Rejected {
                status: 0,
                reason: format!("the request could not be built: {reason}"),
            };
        }
    };
    let url = format!("{}{path}", call.base_url.trim_end_matches('/'));
    let method = reqwest::Method::from_bytes(c.method.as_bytes()).unwrap_or(reqwest::Method::POST);
    let mut body = call.input.clone();
    if !c.identity_field.is_empty() {
        // the identity is where a status query will look for it, or nothing is sent: a
        // request the query cannot find would read as "never arrived"
        let Some(fields) = body.as_object_mut() else {
            return CallOutcome::Rejected {
                status: 0,
                reason: format!(
                    "the request could not be built: the step's input is not a JSON object, so it cannot carry {:?}",
                    c.identity_field
                ),
            };
        };
        fields.insert(
            c.identity_field.clone(),
            Value::String(call.identity.to_owned()),
        );
    }
    let mut request = client
        .request(method, url)
        .headers(call.headers.clone())
        .json(&body)
        .timeout(call.timeout);
    if !c.idempotency_header.is_empty() {
        request = request.header(c.idempotency_header.as_str(), call.identity);
    }
    let resp = match request.send().await {
        Ok(resp) => resp,
        // not connected, or not even built: nothing left
        Err(e) if e.is_connect() || e.is_builder() => {
            return CallOutcome::NotSent {
                reason: e.to_string(),
            };
        }
        Err(e) => {
            return CallOutcome::Unknown {
                reason: if e.is_timeout() {
                    format!("no answer within {} ms", call.timeout.as_millis())
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
    if let Some(outcome) = settled_by_status(c, status, header) {
        return outcome;
    }
    settled_by_body(c, status, read_bounded(resp).await)
}

/// Asks the adapter's API about the request `identity`, by its contract's status query (which
/// a queryable adapter has: the gateway checks at start).
pub async fn query(client: &reqwest::Client, call: Call<'_>) -> QueryOutcome {
    let Some(q) = &call.contract.query else {
        return QueryOutcome::Unknown {
            reason: "the adapter has no status query".into(),
        };
    };
    let path = match fill(&q.path, call.operation, call.identity, call.input) {
        Ok(p) => p,
        Err(reason) => return QueryOutcome::Unknown { reason },
    };
    let url = format!("{}{path}", call.base_url.trim_end_matches('/'));
    let method = reqwest::Method::from_bytes(q.method.as_bytes()).unwrap_or(reqwest::Method::GET);
    let sent = client
        .request(method, url)
        .headers(call.headers.clone())
        .timeout(call.timeout)
        .send()
        .await;
    let resp = match sent {
        Ok(r) => r,
        Err(e) => {
            return QueryOutcome::Unknown {
                reason: e.to_string(),
            };
        }
    };
    let status = resp.status().as_u16();
    let body = read_bounded(resp).await;
    query_settled(q, status, body)
}

/// What a status query's answer establishes, by the contract's rules alone: found (with its
/// reference), definitely not found, or unknown, which includes "still being processed" and
/// every answer no rule names (a route the API does not have is not "never arrived").
fn query_settled(q: &QueryContract, status: u16, body: Result<String, String>) -> QueryOutcome {
    let in_flight = q.in_flight.iter().any(|p| p.matches(status));
    if in_flight && z29c_store::faults::broken(z29c_store::faults::Break::InProgressAsNotFound) {
        // the broken build that takes "still being processed" for "never received"
        return QueryOutcome::NotFound;
    }
    if in_flight {
        return QueryOutcome::Unknown {
            reason: "the destination is still processing the request".into(),
        };
    }
    let value = body
        .as_ref()
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(t).ok());
    if let Some(reference) = q.found.matches(status, value.as_ref()) {
        let value = value.unwrap_or(Value::Null);
        let result = match &q.found.result {
            Some(pointer) => value.pointer(pointer).cloned().unwrap_or(value),
            None => value,
        };
        return QueryOutcome::Found { reference, result };
    }
    if q.not_found
        .iter()
        .any(|r| r.matches(status, value.as_ref()).is_some())
    {
        return QueryOutcome::NotFound;
    }
    QueryOutcome::Unknown {
        reason: match body {
            Err(reason) => reason,
            Ok(_) => format!("status query answered {status}, which no rule of the adapter names"),
        },
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
                settled_by_status(&HttpContract::default(), 429, header),
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
        // a status no list of the contract names (a redirect, which is never followed) is
        // unknown too
        for status in [409, 500, 502, 503, 504, 599, 301, 302] {
            let o = settled_by_status(&HttpContract::default(), status, None)
                .expect("settled by its status");
            assert!(unknown(&o), "{status}: {o:?}");
        }
    }

    #[test]
    fn other_statuses_leave_it_to_the_body() {
        for status in [200, 201, 202, 204, 400, 401, 403, 404, 408, 410, 422, 425] {
            assert_eq!(
                settled_by_status(&HttpContract::default(), status, Some("5")),
                None,
                "{status}"
            );
        }
    }

    #[test]
    fn a_success_counts_only_with_its_reference() {
        let body = |s: &str| Ok(s.to_owned());
        for status in [200, 201] {
            assert_eq!(
                settled_by_body(
                    &HttpContract::default(),
                    status,
                    body(r#"{"reference":"r-1","x":2}"#)
                ),
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
            let o = settled_by_body(&HttpContract::default(), status, body(text));
            assert!(unknown(&o), "{status} {text}: {o:?}");
        }
    }

    #[test]
    fn a_body_lost_or_too_large_is_unknown_whatever_the_status() {
        for status in [200, 201, 400] {
            let o = settled_by_body(
                &HttpContract::default(),
                status,
                Err("answer lost while reading".into()),
            );
            assert!(unknown(&o), "{status}: {o:?}");
        }
    }

    #[test]
    fn a_client_error_is_a_refusal_with_its_reason() {
        assert_eq!(
            settled_by_body(
                &HttpContract::default(),
                400,
                Ok(r#"{"error":"card declined"}"#.into())
            ),
            CallOutcome::Rejected {
                status: 400,
                reason: "card declined".into()
            }
        );
        assert_eq!(
            settled_by_body(&HttpContract::default(), 422, Ok("not json".into())),
            CallOutcome::Rejected {
                status: 422,
                reason: "rejected".into()
            }
        );
    }

    #[tokio::test]
    async fn an_identity_field_the_input_cannot_carry_sends_nothing() {
        let contract = HttpContract {
            identity_field: "customer_reference".into(),
            ..HttpContract::default()
        };
        let headers = HeaderMap::new();
        let input = serde_json::json!(["not", "an", "object"]);
        let outcome = invoke(
            &reqwest::Client::new(),
            Call {
                contract: &contract,
                headers: &headers,
                // nothing listens here: a request sent would be "not sent", not a refusal
                base_url: "http://127.0.0.1:9",
                operation: "ship",
                identity: "z29c:w:s",
                input: &input,
                timeout: Duration::from_secs(1),
            },
        )
        .await;
        assert!(
            matches!(&outcome, CallOutcome::Rejected { status: 0, reason } if reason.contains("customer_reference")),
            "{outcome:?}"
        );
    }

    #[test]
    fn a_status_query_says_no_only_where_a_rule_says_so() {
        let q = QueryContract::default();
        let ok = |s: &str| Ok(s.to_owned());
        assert_eq!(query_settled(&q, 404, ok("")), QueryOutcome::NotFound);
        for status in [202, 409, 400, 410, 429, 500, 503] {
            assert!(
                matches!(
                    query_settled(&q, status, ok("{}")),
                    QueryOutcome::Unknown { .. }
                ),
                "{status}"
            );
        }
        assert_eq!(
            query_settled(&q, 200, ok(r#"{"reference":"r-9"}"#)),
            QueryOutcome::Found {
                reference: "r-9".into(),
                result: serde_json::json!({"reference": "r-9"}),
            }
        );
        for body in [ok("{}"), ok("r-9"), Err("lost".to_owned())] {
            assert!(
                matches!(
                    query_settled(&q, 200, body.clone()),
                    QueryOutcome::Unknown { .. }
                ),
                "{body:?}"
            );
        }
        // a contract whose "not found" is an empty search: a 404 is no longer a "no"
        let search = QueryContract {
            path: "/shipments?reference={identity}".into(),
            found: crate::contract::AnswerRule {
                status: vec![crate::contract::StatusPattern::Exact(200)],
                reference: Some("/data/0/id".into()),
                empty: None,
                result: Some("/data/0".into()),
            },
            not_found: vec![crate::contract::AnswerRule {
                status: vec![crate::contract::StatusPattern::Exact(200)],
                reference: None,
                empty: Some("/data".into()),
                result: None,
            }],
            ..QueryContract::default()
        };
        assert_eq!(
            query_settled(&search, 200, ok(r#"{"data":[]}"#)),
            QueryOutcome::NotFound
        );
        assert!(matches!(
            query_settled(&search, 404, ok("")),
            QueryOutcome::Unknown { .. }
        ));
        // the result is the request's own, as its call would have answered
        assert_eq!(
            query_settled(
                &search,
                200,
                ok(r#"{"data":[{"id":"shp_4","status":"sent"}]}"#)
            ),
            QueryOutcome::Found {
                reference: "shp_4".into(),
                result: serde_json::json!({ "id": "shp_4", "status": "sent" }),
            }
        );
    }
}
