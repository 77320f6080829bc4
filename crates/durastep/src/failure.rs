//! How user code fails a step or a run.
//!
//! [`HandlerError`] is what step closures and handlers return. Any
//! `std::error::Error` converts into it with `?`, so user code needs no
//! mapping; the constructors mark a failure permanent or give a retry-after.

use std::fmt;
use std::time::Duration;

/// A failure of a step or of a handler.
///
/// A retryable failure ends the attempt and the run is retried with the
/// function's backoff (or after [`HandlerError::retry_after`]'s delay). A
/// permanent one fails the run at once.
///
/// ```
/// use durastep::HandlerError;
/// use std::time::Duration;
///
/// fn parse(s: &str) -> Result<u32, HandlerError> {
///     Ok(s.parse::<u32>()?) // any std error converts with `?`
/// }
/// assert!(parse("x").is_err());
/// assert!(HandlerError::permanent("no such campaign").is_permanent());
/// let e = HandlerError::retry_after("HTTP 429", Duration::from_secs(30));
/// assert_eq!(e.retry_after_delay(), Some(Duration::from_secs(30)));
/// ```
pub struct HandlerError {
    message: String,
    permanent: bool,
    retry_after: Option<Duration>,
    /// The step whose failure this is (set by the step that ended the attempt).
    step: Option<String>,
}

/// What handlers and step closures return.
///
/// ```
/// fn ok() -> durastep::HandlerResult<u8> { Ok(1) }
/// assert_eq!(ok().unwrap(), 1);
/// ```
pub type HandlerResult<T> = Result<T, HandlerError>;

impl HandlerError {
    /// A retryable failure with a message.
    ///
    /// ```
    /// assert!(!durastep::HandlerError::new("timeout").is_permanent());
    /// ```
    pub fn new(message: impl Into<String>) -> Self {
        HandlerError { message: message.into(), permanent: false, retry_after: None, step: None }
    }

    /// A failure that retrying cannot fix: the run fails at once.
    ///
    /// ```
    /// assert!(durastep::HandlerError::permanent("bad input").is_permanent());
    /// ```
    pub fn permanent(message: impl Into<String>) -> Self {
        HandlerError { message: message.into(), permanent: true, retry_after: None, step: None }
    }

    /// A retryable failure that names when to try again (an HTTP 429's Retry-After).
    ///
    /// ```
    /// let e = durastep::HandlerError::retry_after("429", std::time::Duration::from_secs(5));
    /// assert!(!e.is_permanent());
    /// ```
    pub fn retry_after(message: impl Into<String>, delay: Duration) -> Self {
        HandlerError { message: message.into(), permanent: false, retry_after: Some(delay), step: None }
    }

    /// The message that is stored as the run's `last_error`.
    ///
    /// ```
    /// assert_eq!(durastep::HandlerError::new("x").message(), "x");
    /// ```
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether the failure is permanent.
    ///
    /// ```
    /// assert!(!durastep::HandlerError::new("x").is_permanent());
    /// ```
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }

    /// The delay asked for by [`HandlerError::retry_after`], if any.
    ///
    /// ```
    /// assert_eq!(durastep::HandlerError::new("x").retry_after_delay(), None);
    /// ```
    pub fn retry_after_delay(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Marks the failure as the failure of step `key` (kept on the run's history).
    pub(crate) fn at_step(mut self, key: &str) -> Self {
        self.step = Some(key.to_owned());
        self
    }

    /// The step whose failure ended the attempt, when it ended at a step.
    pub(crate) fn step(&self) -> Option<&str> {
        self.step.as_deref()
    }
}

// Like anyhow::Error, HandlerError does not implement std::error::Error itself,
// which is what lets every error type convert into it with `?`.
impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    /// The error's text and its sources', joined by `": "`; a database error
    /// reads as the server's message and SQLSTATE, without the server's
    /// source-file line (`... at line 123`) or the same message twice.
    fn from(e: E) -> Self {
        let mut message = String::new();
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(err) = next {
            if !message.is_empty() {
                message.push_str(": ");
            }
            next = err.source();
            if let Some(sqlx_error) = err.downcast_ref::<sqlx::Error>() {
                message.push_str(&crate::error::describe(sqlx_error));
                if matches!(sqlx_error, sqlx::Error::Database(_)) {
                    // Its source is the same database error again.
                    next = None;
                }
            } else if let Some(db) = err.downcast_ref::<sqlx::postgres::PgDatabaseError>() {
                message.push_str(db.message());
            } else {
                message.push_str(&err.to_string());
            }
        }
        HandlerError::new(message)
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("message", &self.message)
            .field("permanent", &self.permanent)
            .field("retry_after", &self.retry_after)
            .finish()
    }
}
