//! A one-value channel whose receiver is a `Future` (any executor: the
//! sender wakes the task's `Waker`) or a blocking wait (the sender unparks
//! the thread). One allocation per channel (the shared cell); `send` never
//! blocks, so a data core can complete it from its executor.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

struct State<T> {
    value: Option<T>,
    waker: Option<Waker>,
    thread: Option<Thread>,
    sender_gone: bool,
    receiver_gone: bool,
}

struct Inner<T> {
    state: Mutex<State<T>>,
}

impl<T> Inner<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panic while the lock is held leaves plain data behind.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Makes a channel.
pub(crate) fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let inner = Arc::new(Inner {
        state: Mutex::new(State {
            value: None,
            waker: None,
            thread: None,
            sender_gone: false,
            receiver_gone: false,
        }),
    });
    (
        Sender {
            inner: Some(inner.clone()),
        },
        Receiver { inner },
    )
}

/// The sending half; `send` consumes it. Dropped unsent, the receiver sees
/// [`Closed`].
pub(crate) struct Sender<T> {
    inner: Option<Arc<Inner<T>>>,
}

/// The sender was dropped without sending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Closed;

impl<T> Sender<T> {
    /// Sends the value and wakes the receiver.
    ///
    /// # Errors
    /// The value back when the receiver was dropped.
    pub(crate) fn send(mut self, value: T) -> Result<(), T> {
        let Some(inner) = self.inner.take() else {
            return Err(value);
        };
        let (waker, thread) = {
            let mut s = inner.lock();
            if s.receiver_gone {
                return Err(value);
            }
            s.value = Some(value);
            s.sender_gone = true;
            (s.waker.take(), s.thread.take())
        };
        if let Some(w) = waker {
            w.wake();
        }
        if let Some(t) = thread {
            t.unpark();
        }
        Ok(())
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            let (waker, thread) = {
                let mut s = inner.lock();
                s.sender_gone = true;
                (s.waker.take(), s.thread.take())
            };
            if let Some(w) = waker {
                w.wake();
            }
            if let Some(t) = thread {
                t.unpark();
            }
        }
    }
}

/// The receiving half: a `Future` of the value, or [`Self::recv_timeout`].
pub(crate) struct Receiver<T> {
    inner: Arc<Inner<T>>,
}

impl<T> Receiver<T> {
    /// Blocks the calling thread until the value arrives, the sender is
    /// dropped (`Err(Some(Closed))`) or `timeout` passed (`Err(None)`).
    pub(crate) fn recv_timeout(&self, timeout: Duration) -> Result<T, Option<Closed>> {
        // A timeout too long for an `Instant` waits for ever.
        let deadline = Instant::now().checked_add(timeout);
        loop {
            {
                let mut s = self.inner.lock();
                if let Some(v) = s.value.take() {
                    return Ok(v);
                }
                if s.sender_gone {
                    return Err(Some(Closed));
                }
                s.thread = Some(std::thread::current());
            }
            match deadline {
                None => std::thread::park(),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        self.inner.lock().thread = None;
                        return Err(None);
                    }
                    std::thread::park_timeout(deadline - now);
                }
            }
        }
    }
}

impl<T> Future for Receiver<T> {
    type Output = Result<T, Closed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.inner.lock();
        if let Some(v) = s.value.take() {
            return Poll::Ready(Ok(v));
        }
        if s.sender_gone {
            return Poll::Ready(Err(Closed));
        }
        match &s.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => s.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let value = {
            let mut s = self.inner.lock();
            s.receiver_gone = true;
            s.waker = None;
            s.value.take()
        };
        drop(value);
    }
}

/// Runs a future to completion on the calling thread (parks between
/// polls): a minimal `block_on` for tests, examples and plain threads.
pub fn block_on<F: Future>(fut: F) -> F::Output {
    struct Unpark(Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_sent_from_another_thread_wakes_the_future_and_the_thread() {
        let (tx, rx) = channel::<u32>();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(7).unwrap();
        });
        assert_eq!(block_on(rx), Ok(7));
        t.join().unwrap();
        let (tx, rx) = channel::<u32>();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(8).unwrap();
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(8));
        t.join().unwrap();
    }

    #[test]
    fn dropped_halves() {
        let (tx, rx) = channel::<u32>();
        drop(tx);
        assert_eq!(block_on(rx), Err(Closed));
        let (tx, rx) = channel::<u32>();
        drop(rx);
        assert_eq!(tx.send(1), Err(1));
        let (_tx, rx) = channel::<u32>();
        assert_eq!(rx.recv_timeout(Duration::from_millis(10)), Err(None));
    }
}
