//! Any bytes as a NATS message: an envelope that decodes also passes its own checks on a
//! second decode of its re-encoding (nothing is accepted that would be refused later).
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok(envelope) = z29c_proto::envelope::decode(data) {
        let again = z29c_proto::envelope::decode(&envelope.encode_to_vec())
            .expect("a valid envelope re-encodes to a valid envelope");
        assert_eq!(again, envelope);
    }
});
