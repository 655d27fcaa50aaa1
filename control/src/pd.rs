//! Prefill/decode disaggregation, the shell's part: recording hand-offs and releasing
//! their blocks through a decode engine. What is read from bodies and the hand-off table
//! are the core's ([`kvguard_control_core::pd`], re-exported here).

pub use kvguard_control_core::pd::*;

use kvguard_contract::RequestId;
use serde_json::Value;

impl crate::state::AppState {
    fn handoffs(&self) -> std::sync::MutexGuard<'_, Handoffs> {
        self.handoffs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a finished prefill's answered transfer parameters under its id.
    pub fn record_handoff(&self, id: RequestId, params: Value) {
        let now = self.clock.now();
        let mut h = self.handoffs();
        let before = h.evicted();
        h.insert(id, params, now);
        let evicted = h.evicted() - before;
        if evicted > 0 {
            self.metrics.pd.handoffs_evicted.inc_by(evicted);
        }
        self.metrics.pd.handoffs_held.set(h.len() as i64);
    }

    /// Whether a hand-off of `id` is held.
    pub fn holds_handoff(&self, id: &RequestId) -> bool {
        self.handoffs().holds(id, self.clock.now())
    }

    /// Sets the hand-off gauges (before `/metrics` is encoded).
    pub fn refresh_pd_gauges(&self) {
        let now = self.clock.now();
        let mut h = self.handoffs();
        h.purge(now);
        self.metrics.pd.handoffs_held.set(h.len() as i64);
        self.metrics
            .pd
            .handoff_oldest_age
            .set(h.oldest_age(now).as_secs_f64());
    }

    /// An aborted id's hand-off, if one is held: its blocks are released through a decode
    /// engine (`--pd-decode-url`), which rejects [`rejection_body`] and so tells the
    /// prefill engine to let them go. `None`: no hand-off of `id` is held. Once taken from
    /// the table the release runs in a task of its own: a caller that gives up (its
    /// timeout) does not lose it, nor its figures.
    pub async fn release_handoff(self: &std::sync::Arc<Self>, id: &RequestId) -> Option<Release> {
        let now = self.clock.now();
        if self.cfg.dry_run {
            return self.handoffs().holds(id, now).then_some(Release::DryRun);
        }
        let params = {
            let mut h = self.handoffs();
            let p = h.take(id, now)?;
            self.metrics.pd.handoffs_held.set(h.len() as i64);
            p
        };
        let Some(url) = self.cfg.pd_decode_url.as_ref() else {
            self.metrics.pd.release("handoff", "no_route");
            tracing::warn!(request_id = %id, lease = ?self.cfg.pd_kv_lease, "aborted a finished prefill whose blocks the prefill engine holds for a decode side; no --pd-decode-url to release them through: held until the engine's lease");
            return Some(Release::HeldUntilLease);
        };
        let (this, id, base) = (self.clone(), id.clone(), url.base.clone());
        let release = tokio::spawn(async move {
            let released = this.send_rejection(base.clone(), &params).await;
            this.metrics
                .pd
                .release("handoff", if released { "released" } else { "failed" });
            if released {
                tracing::info!(request_id = %id, decode = %base, "released a finished prefill's held blocks through the decode side");
                Release::Released
            } else {
                Release::HeldUntilLease
            }
        });
        Some(release.await.unwrap_or(Release::HeldUntilLease))
    }

    /// A decode leg arrived for an aborted (tombstoned) id, carrying a prefill engine's
    /// transfer parameters: the engine here gets [`rejection_body`] with them, so that it
    /// tells the prefill engine to let the blocks go (refusing the leg alone would leave
    /// them held until the prefill engine's lease). Returns whether it was rejected.
    pub async fn reject_tombstoned_decode(
        self: &std::sync::Arc<Self>,
        id: &RequestId,
        params: &Value,
    ) -> bool {
        let released = self
            .send_rejection(self.cfg.engine.base.clone(), params)
            .await;
        self.metrics.pd.release(
            "tombstoned_decode",
            if released { "released" } else { "failed" },
        );
        tracing::info!(request_id = %id, released, "a decode leg arrived for an aborted id: its prefill engine was told to release the blocks through this decode engine");
        released
    }

    /// Sends [`rejection_body`] with `params` to the decode engine (or kvguard-control) at
    /// `base`, under a fresh id; whether it was rejected ([`is_rejection`]).
    async fn send_rejection(&self, base: String, params: &Value) -> bool {
        let fresh = format!("kvguard-pd-release-{}", uuid::Uuid::new_v4());
        let Ok(fresh) = RequestId::try_new(fresh.as_bytes()) else {
            return false;
        };
        match self
            .engine
            .release_prefill(base.clone(), fresh, rejection_body(params))
            .await
        {
            Ok(status) if is_rejection(status) => true,
            Ok(status) => {
                tracing::warn!(%base, status, "the decode side did not reject the release request (a 400 was expected): the prefill engine's blocks are held until its lease");
                false
            }
            Err(e) => {
                tracing::warn!(%base, error = %e, "release request to the decode side failed: the prefill engine's blocks are held until its lease");
                false
            }
        }
    }
}
