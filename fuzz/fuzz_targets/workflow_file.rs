//! Any text as a workflow file: parsing and conversion to a submission refuse or succeed,
//! never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(file) = z29c_proto::workflow_file::parse(text)
    {
        let _ = file.into_request();
    }
});
