//! A disaggregated vLLM pair: a prefill (P) and a decode (D) server with vLLM's
//! NixlConnector (docs/PD-ENGINES.md), on CPU here (`kv_buffer_device: cpu`, NIXL's UCX
//! backend from PyPI `nixl`, installed by `scripts/setup-vllm`), or on GPUs where
//! `scripts/pd-vllm` started them.
//!
//! P holds a finished prefill's blocks for D until D has read them or P's lease
//! (`kv_lease_duration`, [`LEASE_S`], vLLM's default) runs out: the stranded state a
//! client that leaves between the two legs leaves behind.

use crate::vllm::{self, Vllm, VllmOptions};
use anyhow::{bail, Context, Result};
use serde_json::json;

/// P's lease on blocks held for D, in seconds (`kv_connector_extra_config`): vLLM's
/// default, set explicitly. Shorter leases expired before D's read on a loaded 2-core
/// machine (two CPU engines' workers each poll about a core).
pub const LEASE_S: u64 = 30;

/// `KVGUARD_VLLM_PD_URLS=http://P,http://D`: use a running pair (NixlConnector, lease
/// [`LEASE_S`]) instead of starting one.
pub const URLS_ENV: &str = "KVGUARD_VLLM_PD_URLS";
/// `KVGUARD_VLLM_PD_GPUS=0,1`: start the pair on these CUDA devices (P's, D's; the same
/// one twice shares it) with `kv_buffer_device: cuda`; unset: on CPU.
pub const GPUS_ENV: &str = "KVGUARD_VLLM_PD_GPUS";

/// `--kv-transfer-config` of both sides (`kv_both`: each can serve either role).
pub fn kv_transfer_config(buffer_device: &str) -> String {
    json!({
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": buffer_device,
        "kv_connector_extra_config": {"kv_lease_duration": LEASE_S},
    })
    .to_string()
}

/// The pair.
pub struct VllmPd {
    /// The prefill side.
    pub p: Vllm,
    /// The decode side.
    pub d: Vllm,
}

impl VllmPd {
    /// `None` when `KVGUARD_SKIP_VLLM=1`; the pair at [`URLS_ENV`] when set; else a pair
    /// started here on CPU (both at once: about 2 minutes on 2 cores), killed on drop.
    pub async fn shared(test: &str) -> Result<Option<VllmPd>> {
        if vllm::skip_requested()? {
            eprintln!("SKIPPED {test}: {}=1 (real vLLM not used)", vllm::SKIP_ENV);
            return Ok(None);
        }
        if let Ok(urls) = std::env::var(URLS_ENV) {
            let Some((p, d)) = urls.split_once(',') else {
                bail!("{URLS_ENV}={urls:?}: expected http://P,http://D");
            };
            return Ok(Some(VllmPd {
                p: Vllm::connect(p.trim()).await?,
                d: Vllm::connect(d.trim()).await?,
            }));
        }
        vllm::venv_python()?;
        let gpus = match std::env::var(GPUS_ENV) {
            Ok(g) => match g.split_once(',') {
                Some((p, d)) => Some((p.trim().to_string(), d.trim().to_string())),
                None => bail!("{GPUS_ENV}={g:?}: expected two CUDA device numbers, P's and D's (e.g. 0,1 or 0,0)"),
            },
            Err(_) => None,
        };
        let side = |port: u16, gpu: Option<&str>| -> VllmOptions {
            let mut env = vec![
                (
                    "VLLM_NIXL_SIDE_CHANNEL_HOST".to_string(),
                    "127.0.0.1".to_string(),
                ),
                ("VLLM_NIXL_SIDE_CHANNEL_PORT".to_string(), port.to_string()),
            ];
            let mut extra_args = vec!["--kv-transfer-config".to_string()];
            match gpu {
                Some(g) => {
                    env.push(("CUDA_VISIBLE_DEVICES".into(), g.into()));
                    extra_args.push(kv_transfer_config("cuda"));
                    // Room for both sides when they share one device.
                    extra_args.extend(["--gpu-memory-utilization".into(), "0.35".into()]);
                }
                None => extra_args.push(kv_transfer_config("cpu")),
            }
            VllmOptions {
                // Below the suite's other processes: two CPU engines share 2 cores.
                nice: Some(19),
                enable_scale_out: false,
                max_num_seqs: 16,
                max_model_len: 2048,
                extra_args,
                env,
                ..VllmOptions::default()
            }
        };
        let (gp, gd) = match &gpus {
            Some((p, d)) => (Some(p.as_str()), Some(d.as_str())),
            None => (None, None),
        };
        // NIXL's side channel takes a port named up front: drawn below the ephemeral range,
        // and the pair started again on fresh ones if one was taken before its bind.
        let side = &side;
        let pair = crate::with_free_addrs(2, |ports| async move {
            let (po, dopts) = (side(ports[0].port(), gp), side(ports[1].port(), gd));
            // The first failure drops the other side's start (and kills its server).
            let (p, d) = tokio::try_join!(
                async {
                    Vllm::start_once(po)
                        .await
                        .context("starting the prefill side")
                },
                async {
                    Vllm::start_once(dopts)
                        .await
                        .context("starting the decode side")
                },
            )?;
            Ok(VllmPd { p, d })
        })
        .await?;
        Ok(Some(pair))
    }
}
