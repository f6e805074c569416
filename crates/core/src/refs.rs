//! References from a step's input to what the steps it depends on produced.
//!
//! A string in a step's input may name an upstream step's result or external reference:
//!
//! - `${steps.NAME.result}`: the whole result the step's receipt holds (what the external
//!   system answered);
//! - `${steps.NAME.result/POINTER}`: the value at a JSON pointer (RFC 6901) into it, e.g.
//!   `${steps.reserve.result/id}` or `${steps.quote.result/lines/0/price}`;
//! - `${steps.NAME.reference}`: the external reference the receipt names.
//!
//! A string that is one reference and nothing else is replaced by the value, of whatever JSON
//! type; a reference inside a longer string is replaced by its text (a string as it is, a
//! number or a boolean as written; an object, an array or null cannot be text). `$${` writes a
//! literal `${` (so a `$` cannot stand right before a reference). Only values are read:
//! object keys are sent as they are.
//!
//! References are resolved once, from receipts only, when the step's last dependency has
//! succeeded; the resolved input is what every attempt sends, and what its digest covers.

use serde_json::Value;

/// One reference found in an input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// The upstream step's name.
    pub step: String,
    pub part: Part,
}

/// What of the upstream step a reference takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// The receipt's result at this JSON pointer ("" for the whole result).
    Result(String),
    /// The receipt's external reference.
    Reference,
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.part {
            Part::Result(pointer) => write!(f, "${{steps.{}.result{pointer}}}", self.step),
            Part::Reference => write!(f, "${{steps.{}.reference}}", self.step),
        }
    }
}

/// Why an input's references cannot be read or resolved. `at` is the JSON pointer, into the
/// input, of the string that holds the reference ("" for the input itself).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} (at input{at})")]
pub struct RefError {
    pub at: String,
    pub reason: String,
}

/// What an upstream step produced, as its receipt holds it.
#[derive(Debug, Clone, Copy)]
pub struct Upstream<'a> {
    pub result: &'a Value,
    pub reference: Option<&'a str>,
}

/// One piece of a string: text as it is, or a reference.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Ref(Reference),
}

/// Splits a string into text and references; `$${` is a literal `${`.
fn pieces(s: &str) -> Result<Vec<Piece>, String> {
    let mut out = Vec::new();
    let mut text = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        if rest[..i].ends_with('$') {
            text.push_str(&rest[..i - 1]);
            text.push_str("${");
            rest = &rest[i + 2..];
            continue;
        }
        text.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("{:?} opens a reference with `${{` and never closes it", s))?;
        if !text.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut text)));
        }
        out.push(Piece::Ref(parse(&after[..end])?));
        rest = &after[end + 1..];
    }
    text.push_str(rest);
    if !text.is_empty() {
        out.push(Piece::Text(text));
    }
    Ok(out)
}

/// Parses what is between `${` and `}`.
fn parse(inner: &str) -> Result<Reference, String> {
    let form = "write ${steps.NAME.result}, ${steps.NAME.result/POINTER} or ${steps.NAME.reference} (and $${ for a literal ${)";
    let Some(named) = inner.strip_prefix("steps.") else {
        return Err(format!("${{{inner}}} is not a reference: {form}"));
    };
    let (head, pointer) = match named.find('/') {
        Some(i) => named.split_at(i),
        None => (named, ""),
    };
    // RFC 6901: `~` only as `~0` or `~1`
    if pointer
        .split('~')
        .skip(1)
        .any(|after| !(after.starts_with('0') || after.starts_with('1')))
    {
        return Err(format!(
            "${{{inner}}}: in a JSON pointer `~` is written `~0` and `/` inside a key `~1`"
        ));
    }
    let (step, part) = if let Some(step) = head.strip_suffix(".result") {
        (step, Part::Result(pointer.to_owned()))
    } else if let Some(step) = head.strip_suffix(".reference")
        && pointer.is_empty()
    {
        (step, Part::Reference)
    } else {
        return Err(format!("${{{inner}}} is not a reference: {form}"));
    };
    crate::StepName::parse(step)
        .map_err(|e| format!("${{{inner}}}: \"{step}\" is not a step name: {}", e.reason))?;
    Ok(Reference {
        step: step.to_owned(),
        part,
    })
}

/// Calls `f` with each string of `value` and its JSON pointer.
fn strings<E>(
    value: &Value,
    at: &mut String,
    f: &mut impl FnMut(&str, &str) -> Result<(), E>,
) -> Result<(), E> {
    match value {
        Value::String(s) => f(at, s),
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                let len = at.len();
                at.push('/');
                at.push_str(&i.to_string());
                strings(v, at, f)?;
                at.truncate(len);
            }
            Ok(())
        }
        Value::Object(fields) => {
            for (k, v) in fields {
                let len = at.len();
                at.push('/');
                at.push_str(&k.replace('~', "~0").replace('/', "~1"));
                strings(v, at, f)?;
                at.truncate(len);
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Every reference in `input`, with the pointer of the string that holds it; an error names
/// the first string that is not well formed.
pub fn references(input: &Value) -> Result<Vec<(String, Reference)>, RefError> {
    let mut out = Vec::new();
    strings(input, &mut String::new(), &mut |at, s| {
        for piece in pieces(s).map_err(|reason| RefError {
            at: at.to_owned(),
            reason,
        })? {
            if let Piece::Ref(r) = piece {
                out.push((at.to_owned(), r));
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// Whether `input` holds a reference or an escaped `$${` (either way it must be resolved
/// before it is sent).
pub fn needs_resolving(input: &Value) -> bool {
    let mut found = false;
    let _ = strings(input, &mut String::new(), &mut |_, s| {
        found |= s.contains("${");
        Ok::<(), ()>(())
    });
    found
}

/// The largest input resolving may make (1 MiB, a gateway's default request limit): a
/// few references to large results could otherwise build an input no gateway takes.
pub const MAX_RESOLVED_BYTES: usize = 1024 * 1024;

/// `input` with every reference replaced from `upstream` (the receipt of each step it may
/// name, by name). An error names the reference and what is missing, or says the resolved
/// input is larger than [`MAX_RESOLVED_BYTES`].
pub fn resolve<'a>(
    input: &Value,
    upstream: &impl Fn(&str) -> Option<Upstream<'a>>,
) -> Result<Value, RefError> {
    let resolved = resolve_at(input, &mut String::new(), upstream)?;
    let size = serde_json::to_vec(&resolved).map_or(usize::MAX, |v| v.len());
    if size > MAX_RESOLVED_BYTES {
        return Err(RefError {
            at: String::new(),
            reason: format!(
                "resolved, the input is {size} bytes, at most {MAX_RESOLVED_BYTES} allowed"
            ),
        });
    }
    Ok(resolved)
}

fn resolve_at<'a>(
    value: &Value,
    at: &mut String,
    upstream: &impl Fn(&str) -> Option<Upstream<'a>>,
) -> Result<Value, RefError> {
    let error = |at: &str, reason: String| RefError {
        at: at.to_owned(),
        reason,
    };
    Ok(match value {
        Value::String(s) => {
            let pieces = pieces(s).map_err(|r| error(at, r))?;
            match pieces.as_slice() {
                [Piece::Ref(r)] => lookup(r, upstream).map_err(|r| error(at, r))?,
                _ => {
                    let mut text = String::new();
                    for piece in pieces {
                        match piece {
                            Piece::Text(t) => text.push_str(&t),
                            Piece::Ref(r) => {
                                match lookup(&r, upstream).map_err(|e| error(at, e))? {
                                    Value::String(s) => text.push_str(&s),
                                    v @ (Value::Number(_) | Value::Bool(_)) => {
                                        text.push_str(&v.to_string())
                                    }
                                    v => {
                                        return Err(error(
                                            at,
                                            format!(
                                                "{r} is {}, which cannot be put inside text; make it the whole string",
                                                kind(&v)
                                            ),
                                        ));
                                    }
                                }
                            }
                        }
                    }
                    Value::String(text)
                }
            }
        }
        Value::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, v) in items.iter().enumerate() {
                let len = at.len();
                at.push('/');
                at.push_str(&i.to_string());
                out.push(resolve_at(v, at, upstream)?);
                at.truncate(len);
            }
            Value::Array(out)
        }
        Value::Object(fields) => {
            let mut out = serde_json::Map::with_capacity(fields.len());
            for (k, v) in fields {
                let len = at.len();
                at.push('/');
                at.push_str(&k.replace('~', "~0").replace('/', "~1"));
                out.insert(k.clone(), resolve_at(v, at, upstream)?);
                at.truncate(len);
            }
            Value::Object(out)
        }
        other => other.clone(),
    })
}

fn lookup<'a>(
    r: &Reference,
    upstream: &impl Fn(&str) -> Option<Upstream<'a>>,
) -> Result<Value, String> {
    let Some(up) = upstream(&r.step) else {
        return Err(format!("{r}: step {:?} has no result to take", r.step));
    };
    match &r.part {
        Part::Reference => up
            .reference
            .map(|s| Value::String(s.to_owned()))
            .ok_or_else(|| format!("{r}: step {:?} has no external reference", r.step)),
        Part::Result(pointer) => up.result.pointer(pointer).cloned().ok_or_else(|| {
            format!(
                "{r}: the result of step {:?} has nothing at {pointer:?}",
                r.step
            )
        }),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn reserve() -> Value {
        json!({ "id": "res_1", "lines": [{ "sku": "a", "qty": 2 }], "ok": true, "n": null })
    }

    fn upstream<'a>(result: &'a Value) -> impl Fn(&str) -> Option<Upstream<'a>> {
        move |name| {
            (name == "reserve").then_some(Upstream {
                result,
                reference: Some("ref-9"),
            })
        }
    }

    fn r(step: &str, part: Part) -> Reference {
        Reference {
            step: step.into(),
            part,
        }
    }

    #[test]
    fn references_are_found_with_where_they_are() {
        let input = json!({
            "a": "${steps.reserve.result/id}",
            "b": ["x", "order ${steps.charge.reference} of ${steps.my.step.result}"],
            "c~/d": "${steps.reserve.result}",
            "n": 3
        });
        let found = references(&input).unwrap();
        assert_eq!(
            found,
            vec![
                ("/a".into(), r("reserve", Part::Result("/id".into()))),
                ("/b/1".into(), r("charge", Part::Reference)),
                ("/b/1".into(), r("my.step", Part::Result(String::new()))),
                ("/c~0~1d".into(), r("reserve", Part::Result(String::new()))),
            ]
        );
    }

    #[test]
    fn malformed_references_are_named_with_their_place() {
        for (s, says) in [
            ("${steps.x.result", "never closes"),
            ("${step.x.result}", "not a reference"),
            ("${steps.x.output}", "not a reference"),
            ("${steps.x.reference/id}", "not a reference"),
            ("${steps..result}", "step name"),
            ("${steps.a b.result}", "step name"),
            ("${}", "not a reference"),
            ("${steps.x.result/a~2b}", "JSON pointer"),
        ] {
            let e = references(&json!({ "k": [s] })).unwrap_err();
            assert_eq!(e.at, "/k/0", "{s}");
            assert!(e.reason.contains(says), "{s}: {}", e.reason);
        }
    }

    #[test]
    fn an_escaped_dollar_is_text_not_a_reference() {
        let input = json!("costs $${steps.x.result} and $5");
        assert!(references(&input).unwrap().is_empty());
        assert!(needs_resolving(&input));
        let out = resolve(&input, &|_| None).unwrap();
        assert_eq!(out, json!("costs ${steps.x.result} and $5"));
        assert!(!needs_resolving(&json!({ "a": "$5", "b": 1 })));
    }

    #[test]
    fn a_whole_string_reference_keeps_the_values_type() {
        let result = reserve();
        let up = upstream(&result);
        let input = json!({
            "id": "${steps.reserve.result/id}",
            "lines": "${steps.reserve.result/lines}",
            "qty": "${steps.reserve.result/lines/0/qty}",
            "ok": "${steps.reserve.result/ok}",
            "n": "${steps.reserve.result/n}",
            "all": "${steps.reserve.result}",
            "ref": "${steps.reserve.reference}",
            "kept": [1, "plain", { "x": false }]
        });
        assert_eq!(
            resolve(&input, &up).unwrap(),
            json!({
                "id": "res_1",
                "lines": [{ "sku": "a", "qty": 2 }],
                "qty": 2,
                "ok": true,
                "n": null,
                "all": reserve(),
                "ref": "ref-9",
                "kept": [1, "plain", { "x": false }]
            })
        );
    }

    #[test]
    fn references_inside_text_become_text() {
        let result = reserve();
        let up = upstream(&result);
        let input = json!(
            "order ${steps.reserve.result/id}: ${steps.reserve.result/lines/0/qty} x, ok=${steps.reserve.result/ok}, ${steps.reserve.reference}"
        );
        assert_eq!(
            resolve(&input, &up).unwrap(),
            json!("order res_1: 2 x, ok=true, ref-9")
        );
        for pointer in ["/lines", "/n", ""] {
            let e = resolve(
                &json!({ "s": format!("x ${{steps.reserve.result{pointer}}}") }),
                &up,
            )
            .unwrap_err();
            assert_eq!(e.at, "/s");
            assert!(e.reason.contains("cannot be put inside text"), "{e}");
        }
    }

    #[test]
    fn a_missing_step_field_or_reference_is_an_error_naming_it() {
        let result = reserve();
        let up = upstream(&result);
        let e = resolve(&json!({ "a": ["${steps.reserve.result/nope}"] }), &up).unwrap_err();
        assert_eq!(e.at, "/a/0");
        assert!(e.reason.contains("${steps.reserve.result/nope}"), "{e}");
        assert!(e.reason.contains("nothing at \"/nope\""), "{e}");
        let e = resolve(&json!("${steps.other.result}"), &up).unwrap_err();
        assert!(e.reason.contains("step \"other\" has no result"), "{e}");
        let none = |_: &str| {
            Some(Upstream {
                result: &Value::Null,
                reference: None,
            })
        };
        let e = resolve(&json!("${steps.x.reference}"), &none).unwrap_err();
        assert!(e.reason.contains("no external reference"), "{e}");
        assert_eq!(e.to_string(), format!("{} (at input)", e.reason));
    }

    #[test]
    fn a_resolved_input_past_the_limit_is_refused() {
        let big = Value::String("x".repeat(MAX_RESOLVED_BYTES / 4));
        let up = |_: &str| {
            Some(Upstream {
                result: &big,
                reference: None,
            })
        };
        let three = json!([
            "${steps.a.result}",
            "${steps.a.result}",
            "${steps.a.result}"
        ]);
        assert!(resolve(&three, &up).is_ok());
        let five = Value::Array(vec![json!("${steps.a.result}"); 5]);
        let e = resolve(&five, &up).unwrap_err();
        assert!(e.reason.contains("at most 1048576 allowed"), "{e}");
        let escaped = references(&json!("${steps.a.result/k~0ey/a~1b}")).unwrap();
        assert_eq!(escaped[0].1.part, Part::Result("/k~0ey/a~1b".into()));
    }

    #[test]
    fn an_input_without_references_resolves_to_itself() {
        let input = json!({ "a": [1, 2.5, "x$", "{y}", null], "b": { "c": true } });
        assert!(!needs_resolving(&input));
        assert_eq!(resolve(&input, &|_| None).unwrap(), input);
    }

    #[test]
    fn a_reference_displays_as_written() {
        for s in [
            "${steps.a.result}",
            "${steps.a.b.result/x/0}",
            "${steps.a.reference}",
        ] {
            let found = references(&json!(s)).unwrap();
            assert_eq!(found[0].1.to_string(), s);
        }
    }
}
