//! Any bytes as the gateway's `Invoke` request: decoding and validation refuse with a field
//! named, or accept values that are within their bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(req) = z29c_proto::v1::InvokeRequest::decode(data) else {
        return;
    };
    match z29c_proto::validate::invoke(&req) {
        Ok(valid) => {
            assert!(!valid.operation.is_empty() && valid.operation.len() <= 100);
            assert!(!valid.identity.as_str().is_empty());
        }
        Err(e) => assert!(!e.field.is_empty()),
    }
});
