//! The server's accept loop: HTTP/1 connections served by hyper with a cap on how many are open
//! at once, a deadline on each request's headers, and a graceful shutdown that lets running
//! requests finish. (`axum::serve` has neither limit: clients that open connections and send
//! nothing, or half a header, held a file handle each for as long as they liked, and enough of
//! them starved everyone else.) The request bodies' idle timeout is a layer of the router
//! ([`super::routes::router`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// How long a graceful shutdown waits for running requests before it drops them.
const DRAIN: Duration = Duration::from_secs(30);

/// Limits on connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Most connections open at once; the next one is accepted when one closes (until then it
    /// waits in the kernel's backlog).
    pub max_connections: usize,
    /// Longest wait for a request's headers (from the connection's start, or from the end of
    /// the previous response on a kept-alive one).
    pub header_timeout: Duration,
}

/// Serve `app` on `listener` until `shutdown` completes, then stop accepting and give running
/// connections up to [`DRAIN`] to finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p?,
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file handles or a connection reset before it was accepted: say so
                    // and go on (a busy loop would not help the handles come back).
                    eprintln!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // A connection's errors (a client gone, headers too slow) concern that client only.
            let _ = conn.await;
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN, graceful.shutdown()).await.is_err() {
        eprintln!("shutdown: requests still running after {} s were dropped", DRAIN.as_secs());
    }
    Ok(())
}
