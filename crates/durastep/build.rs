//! `sqlx::migrate!` embeds the migrations at compile time; without this, a
//! new migration file alone would not rebuild the crate (stable Rust has no
//! tracked paths for proc macros), and a stale build would ship without it.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
