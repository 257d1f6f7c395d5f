//! The engine thread: it owns the executor (`Send`, not `Sync`) and the scheduler, takes
//! commands from HTTP handlers over a channel, and runs continuous-batching steps while there is
//! work. Each request's events go back to its handler over its own channel; a handler that went
//! away (client disconnected) closes that channel, which the scheduler sees as a cancellation and
//! frees the sequence's KV at the next step.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use spark_core::scheduler::{Control, Event, Metrics, Request, Scheduler, Sink, SubmitError};
use spark_core::Executor;
use tokio::sync::{mpsc as tmpsc, oneshot};

/// A command to the engine thread.
pub enum Cmd {
    Submit {
        req: Box<Request>,
        sink: Box<dyn Sink>,
        reply: oneshot::Sender<Result<u64, SubmitError>>,
    },
    Cancel(u64),
    /// End a request whose stop string the HTTP side found (counted as finished, not cancelled).
    Stop(u64),
}

/// How a chat request's output is steered while it is generated.
#[derive(Debug, Clone, Default)]
pub struct Steer {
    /// `(tokens left, </think> id)` while the reasoning block is open and budgeted.
    pub think_budget: Option<(usize, u32)>,
    /// `(</think> id, tokens)`: once the reasoning ends, these tokens come next (the start of a
    /// tool call that `tool_choice` requires).
    pub after_think: Option<(u32, Vec<u32>)>,
}

/// Forwards events to a handler; forces `</think>` after a reasoning budget and the tokens
/// [`Steer::after_think`] asks for.
pub struct ChanSink {
    pub tx: tmpsc::UnboundedSender<Event>,
    pub steer: Steer,
    /// Tokens still to force, one per event.
    queue: std::collections::VecDeque<u32>,
}

impl Sink for ChanSink {
    fn event(&mut self, e: Event) -> Control {
        let mut ctl = Control::Continue;
        if let (Event::Token { id, .. }, Some((left, end))) = (&e, &mut self.steer.think_budget) {
            if *id == *end {
                self.steer.think_budget = None;
            } else if *left <= 1 {
                ctl = Control::ForceNext(*end);
                self.steer.think_budget = None;
            } else {
                *left -= 1;
            }
        }
        if let Event::Token { id, stop: false, .. } = &e {
            if self.steer.after_think.as_ref().is_some_and(|(end, _)| end == id) {
                let (_, then) = self.steer.after_think.take().unwrap_or_default();
                self.queue.extend(then);
            }
            if let Some(t) = self.queue.pop_front() {
                ctl = Control::ForceNext(t);
            }
        }
        if self.tx.send(e).is_err() {
            return Control::Stop;
        }
        ctl
    }

    fn cancelled(&self) -> bool {
        self.tx.is_closed()
    }
}

/// Handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Cmd>,
    pub metrics: Arc<Mutex<Metrics>>,
}

impl EngineHandle {
    /// Start the engine thread.
    pub fn start(mut exec: Box<dyn Executor>, mut sch: Scheduler) -> std::io::Result<EngineHandle> {
        let (tx, rx) = mpsc::channel::<Cmd>();
        let metrics = Arc::new(Mutex::new(Metrics::default()));
        let m = metrics.clone();
        std::thread::Builder::new().name("spark-engine".into()).spawn(move || {
            let run = std::panic::AssertUnwindSafe(|| engine_loop(exec.as_mut(), &mut sch, &rx, &m));
            if std::panic::catch_unwind(run).is_err() {
                eprintln!("error: the engine thread panicked; the server can no longer generate");
            }
        })?;
        Ok(EngineHandle { tx, metrics })
    }

    /// Queue a request; its events arrive on the returned receiver.
    pub async fn submit(
        &self,
        req: Request,
        steer: Steer,
    ) -> Result<(u64, tmpsc::UnboundedReceiver<Event>), EngineError> {
        let (etx, erx) = tmpsc::unbounded_channel();
        let (rtx, rrx) = oneshot::channel();
        let sink = Box::new(ChanSink { tx: etx, steer, queue: Default::default() });
        self.tx.send(Cmd::Submit { req: Box::new(req), sink, reply: rtx }).map_err(|_| EngineError::Down)?;
        match rrx.await {
            Ok(Ok(h)) => Ok((h, erx)),
            Ok(Err(e)) => Err(EngineError::Rejected(e)),
            Err(_) => Err(EngineError::Down),
        }
    }

    /// End a request now (its KV is freed at the engine's next step).
    pub fn cancel(&self, handle: u64) {
        let _ = self.tx.send(Cmd::Cancel(handle));
    }

    /// End a request because a stop string matched (its KV is freed at the engine's next step).
    pub fn stop(&self, handle: u64) {
        let _ = self.tx.send(Cmd::Stop(handle));
    }

    pub fn metrics(&self) -> Metrics {
        self.metrics.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

/// Why a submission failed.
#[derive(Debug)]
pub enum EngineError {
    Rejected(SubmitError),
    Down,
}

fn engine_loop(exec: &mut dyn Executor, sch: &mut Scheduler, rx: &mpsc::Receiver<Cmd>, metrics: &Mutex<Metrics>) {
    let handle = |sch: &mut Scheduler, c: Cmd| match c {
        Cmd::Submit { req, sink, reply } => {
            let _ = reply.send(sch.submit(*req, sink));
        }
        Cmd::Cancel(h) => sch.cancel(h),
        Cmd::Stop(h) => sch.stop(h),
    };
    loop {
        if sch.is_idle() {
            match rx.recv() {
                Ok(c) => handle(sch, c),
                Err(_) => return,
            }
        }
        while let Ok(c) = rx.try_recv() {
            handle(sch, c);
        }
        sch.step(exec);
        if let Ok(mut m) = metrics.lock() {
            *m = sch.metrics().clone();
        }
    }
}
