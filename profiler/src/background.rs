//! A task on a thread of its own, with its own current-thread runtime, for
//! the work that must not wait while the session's loop is busy (loading
//! probes at a target restart takes seconds; a slot's export, tens of
//! milliseconds): the RPC slot source stamps slot starts, the HTTP server
//! answers /metrics. Stops when aborted or dropped.

use std::future::Future;

pub struct Background {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Background {
    /// Runs the future `make` returns (made on the new thread, so it need
    /// not be `Send`) until it ends or the handle is aborted.
    pub fn spawn<F, Fut>(name: &str, make: F) -> std::io::Result<Self>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new().name(name.into()).spawn(move || {
            runtime.block_on(async move {
                tokio::select! {
                    _ = make() => {}
                    _ = stopped => {}
                }
            });
            // Dropping the runtime cancels what the task spawned.
        })?;
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Stops the task and waits for its thread (its sockets are closed
    /// when this returns).
    pub fn abort(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_on_its_own_thread_and_stops_when_aborted() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut b = Background::spawn("slotprof-test", move || async move {
            let name = std::thread::current().name().map(str::to_string);
            tx.send(name).unwrap();
            std::future::pending::<()>().await;
        })
        .unwrap();
        let name = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
        assert_eq!(name.as_deref(), Some("slotprof-test"));
        let t = std::time::Instant::now();
        b.abort();
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
    }
}
