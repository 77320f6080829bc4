//! The `demo` command.

/// The demo's own database.
pub const DATABASE: &str = "durastep_media_buying";

/// Runs the demo.
pub async fn run() -> Result<(), crate::Error> {
    Ok(())
}
