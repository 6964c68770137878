//! The message of a caught panic, for turning panics in library code and rank threads into
//! errors that say what went wrong.

use std::any::Any;

/// The text a panic was raised with (`panic!("...")` gives a `&str` or a `String`), or
/// nothing for other payloads.
pub fn message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}
