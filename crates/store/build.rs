//! `sqlx::migrate!` embeds `migrations/` at compile time; cargo does not know that, so a
//! changed migration would leave a stale copy in the binary (one process applying one
//! checksum, another refusing it). Rebuild when the folder changes.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
