//! The lease renewed in the background, on a connection of its own.

use std::sync::{Arc, Condvar, Mutex};

use crate::core::pool::renew_every;

use super::{ConnSpec, PoolSlot, RENEW, STATEMENT_TIMEOUT, secs};

/// The lease renewed in the background while the process runs (a long `tofu apply`, a launch,
/// a wait): every third of the lease, on its own connection, made at its first renewal. A
/// process stopped (SIGSTOP) renews nothing: its lease lapses and its cycles are adopted.
pub(super) struct Renewer {
    stop: Arc<(Mutex<bool>, Condvar)>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Renewer {
    pub(super) fn start(spec: Arc<ConnSpec>, me: PoolSlot) -> Renewer {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name("lease".into())
            .spawn(move || {
                let every = renew_every(me.lease);
                let mut client: Option<postgres::Client> = None;
                loop {
                    let (lock, cv) = &*flag;
                    let Ok(guard) = lock.lock() else { return };
                    let Ok((guard, _)) = cv.wait_timeout_while(guard, every, |s| !*s) else {
                        return;
                    };
                    if *guard {
                        return;
                    }
                    drop(guard);
                    if client.as_ref().is_none_or(|c| c.is_closed()) {
                        client = match spec
                            .connect("ci-ephemeral-provisioner-lease", STATEMENT_TIMEOUT)
                        {
                            Ok(c) => Some(c),
                            Err(e) => {
                                log::warn!("renewing the lease of host {}: {e:#}", me.host);
                                continue;
                            }
                        };
                    }
                    if let Some(c) = client.as_mut()
                        && let Err(e) = c.execute(
                            format!("WITH {RENEW} SELECT 1 FROM h").as_str(),
                            &[&me.pool, &me.host, &me.machine, &secs(me.lease)],
                        )
                    {
                        log::warn!(
                            "renewing the lease of host {} failed: {}",
                            me.host,
                            spec.scrub(&e.to_string())
                        );
                    }
                }
            })
            .ok();
        Renewer { stop, handle }
    }

    pub(super) fn stop(mut self) {
        let (lock, cv) = &*self.stop;
        if let Ok(mut s) = lock.lock() {
            *s = true;
            cv.notify_all();
        }
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
