//! What a command prints: JSON for scripts (`--json`) or text for people,
//! gathered here and written by `main` once the command has succeeded.

use serde::Serialize;

use crate::error::CliError;

/// The output of one command.
#[derive(Debug)]
pub struct Out {
    /// Whether `--json` was given.
    pub json: bool,
    text: String,
}

impl Out {
    /// Output in JSON (`json`) or for people.
    pub fn new(json: bool) -> Self {
        Out { json, text: String::new() }
    }

    /// Writes `value` as pretty JSON.
    pub fn json<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), CliError> {
        let text = serde_json::to_string_pretty(value).map_err(|e| CliError::Io(format!("cannot write JSON: {e}")))?;
        self.line(text);
        Ok(())
    }

    /// Writes one line (or a block that ends without a newline).
    pub fn line(&mut self, text: impl AsRef<str>) {
        let text = text.as_ref();
        self.text.push_str(text);
        if !text.ends_with('\n') {
            self.text.push('\n');
        }
    }

    /// Writes a block as it is (a rendered table).
    pub fn block(&mut self, text: &str) {
        self.text.push_str(text);
    }

    /// Everything written.
    pub fn into_text(self) -> String {
        self.text
    }
}
