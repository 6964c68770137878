//! How a JSON value appears in an error: its first 40 characters, so that a long document
//! does not flood the message.

use serde_json::Value;

/// The start of a value, to show in an error.
pub(super) fn shown(value: &Value) -> String {
    value.to_string().chars().take(40).collect()
}
