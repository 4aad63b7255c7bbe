//! The asynchronous embedding API under the typed one ([`crate::typed`]):
//! [`AskFuture`], the answer of [`crate::EntityRef::ask_async`], and
//! [`block_on`] for plain threads.
//!
//! The future is completed from the data core's thread through a small
//! one-value channel (a mutex-guarded cell and the waiting task's `Waker`),
//! so it needs no particular runtime: it works under tokio, async-std,
//! smol, or [`block_on`]. The data core, not a timer of the caller's
//! executor, ends the wait: an ask with no answer by its wait (see
//! [`crate::EntityRef::ask`]) is answered [`crate::AskError::TimedOut`]
//! by the core's 5 ms tick.
//!
//! # Cancel safety
//! The message is sent when `ask_async` is called, not when the future is
//! first polled. Dropping the [`AskFuture`] (a `select!` that took another
//! branch, a `tokio::time::timeout`, an HTTP client gone) does not recall
//! the message: it is delivered and handled as if the future were still
//! there (at most once), and its reply is discarded by the data core when
//! it arrives. So a dropped ask may still have had its effect; retry only
//! commands that are safe to repeat.

pub(crate) mod oneshot;

pub use oneshot::block_on;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use thiserror::Error;

use crate::envelope::Status;

/// Errors from an [`crate::EntityRef::ask`] (also `shardline::node::AskError`).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AskError {
    /// The entity id is invalid.
    #[error(transparent)]
    Id(#[from] shardline_core::ids::IdError),
    /// The request failed with this status.
    #[error("request failed: {0:?}")]
    Failed(Status),
    /// No answer within the timeout (the outcome is unknown): this node
    /// gave up waiting, or the node that forwarded the message to the
    /// entity's home did (an answer with [`Status::TimedOut`] is reported
    /// as this variant, never as `Failed(Status::TimedOut)`).
    #[error("timed out")]
    TimedOut,
    /// The node is stopped.
    #[error("node stopped")]
    Stopped,
}

/// What an embedding-API ask is answered on: `Some((status, payload))`,
/// or `None` when the data core gave up waiting (its `wait` after the ask
/// arrived).
pub(crate) type ApiAnswer = Option<(Status, Vec<u8>)>;

/// Why a message was not sent ([`SendError`]); nothing reached the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum NotSent {
    /// The data core's inbox is full (64 Ki messages): back off and retry.
    #[error("the data core's inbox is full")]
    InboxFull,
    /// The node has stopped.
    #[error("node stopped")]
    Stopped,
    /// The message is longer than `requests.max_message_size_bytes`: the
    /// limit every front applies (HTTP `413`, native `TooLarge`), checked
    /// before sending wherever the entity lives. A retry can never
    /// succeed.
    #[error("message of {size} bytes exceeds requests.max_message_size_bytes ({limit})")]
    TooLarge {
        /// The message's length, in bytes.
        size: u64,
        /// The node's `requests.max_message_size_bytes`.
        limit: u64,
    },
}

/// A message that could not be sent, handed back with the reason.
#[derive(Debug, Error)]
#[error("not sent: {reason}")]
pub struct SendError<M> {
    /// The message, unchanged.
    pub message: M,
    /// Why it was not sent.
    pub reason: NotSent,
}

/// The answer to an [`crate::EntityRef::ask_async`]: resolves to the
/// entity's reply payload.
///
/// Resolves, from the data core's thread, to `Ok(payload)`,
/// [`AskError::Failed`] with the status of a failed request,
/// [`AskError::TimedOut`] when no answer came by the ask's wait, or
/// [`AskError::Stopped`] when the node stopped. See the module docs for
/// cancel safety.
#[must_use = "the reply is only read by awaiting the future (the message is sent already)"]
pub struct AskFuture {
    rx: oneshot::Receiver<ApiAnswer>,
}

impl AskFuture {
    pub(crate) fn new(rx: oneshot::Receiver<ApiAnswer>) -> Self {
        AskFuture { rx }
    }

    /// Blocks the calling thread until the answer, or `wait` passed
    /// ([`AskError::TimedOut`]).
    ///
    /// # Errors
    /// As the future.
    pub fn wait(self, wait: std::time::Duration) -> Result<Vec<u8>, AskError> {
        match self.rx.recv_timeout(wait) {
            Ok(a) => answer(a),
            Err(Some(oneshot::Closed)) => Err(AskError::Stopped),
            Err(None) => Err(AskError::TimedOut),
        }
    }
}

fn answer(a: ApiAnswer) -> Result<Vec<u8>, AskError> {
    match a {
        Some((Status::Ok, payload)) => Ok(payload),
        // A node that forwarded the ask gave up waiting for its answer:
        // the same outcome as this node giving up (the typed API merges
        // them too), so one variant says it wherever the entity lives.
        Some((Status::TimedOut, _)) => Err(AskError::TimedOut),
        Some((status, _)) => Err(AskError::Failed(status)),
        None => Err(AskError::TimedOut),
    }
}

/// An answer with the payload of a failed request (the typed API keeps
/// it).
pub(crate) enum RawAnswer {
    Reply(Vec<u8>),
    Failed(Status, Vec<u8>),
    TimedOut,
    Stopped,
}

/// The future of a raw answer (status and payload), for the typed API.
pub(crate) struct RawAskFuture {
    rx: oneshot::Receiver<ApiAnswer>,
}

impl RawAskFuture {
    pub(crate) fn new(rx: oneshot::Receiver<ApiAnswer>) -> Self {
        RawAskFuture { rx }
    }

    pub(crate) fn wait(self, wait: std::time::Duration) -> RawAnswer {
        match self.rx.recv_timeout(wait) {
            Ok(a) => raw(a),
            Err(Some(oneshot::Closed)) => RawAnswer::Stopped,
            Err(None) => RawAnswer::TimedOut,
        }
    }
}

fn raw(a: ApiAnswer) -> RawAnswer {
    match a {
        Some((Status::Ok, payload)) => RawAnswer::Reply(payload),
        Some((status, payload)) => RawAnswer::Failed(status, payload),
        None => RawAnswer::TimedOut,
    }
}

impl Future for RawAskFuture {
    type Output = RawAnswer;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<RawAnswer> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(a)) => Poll::Ready(raw(a)),
            Poll::Ready(Err(oneshot::Closed)) => Poll::Ready(RawAnswer::Stopped),
        }
    }
}

impl Future for AskFuture {
    type Output = Result<Vec<u8>, AskError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(a)) => Poll::Ready(answer(a)),
            Poll::Ready(Err(oneshot::Closed)) => Poll::Ready(Err(AskError::Stopped)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forwarded_ask_that_timed_out_is_answered_as_a_local_one() {
        assert!(matches!(
            answer(Some((Status::TimedOut, Vec::new()))),
            Err(AskError::TimedOut)
        ));
        assert!(matches!(answer(None), Err(AskError::TimedOut)));
        assert!(matches!(
            answer(Some((Status::Unavailable, Vec::new()))),
            Err(AskError::Failed(Status::Unavailable))
        ));
        assert_eq!(
            answer(Some((Status::Ok, b"x".to_vec()))).ok(),
            Some(b"x".to_vec())
        );
    }
}
