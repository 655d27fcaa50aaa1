//! GPU memory through NVML, behind [`GpuProbe`] so that the logic is testable without a GPU.
//!
//! NVML (`libnvidia-ml.so`) is loaded at run time by `nvml-wrapper`, so the binary builds
//! and runs everywhere; where it cannot be loaded (no driver, no GPU, a container without
//! the library) kvguard-control says so once and reports `kvguard_control_nvml_available 0`.

use serde::Serialize;

/// One device's memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceMemory {
    /// NVML index.
    pub index: u32,
    /// Product name.
    pub name: String,
    /// Device UUID.
    pub uuid: String,
    /// Total framebuffer memory, bytes.
    pub total_bytes: u64,
    /// Used, bytes.
    pub used_bytes: u64,
    /// Free, bytes.
    pub free_bytes: u64,
    /// Processes holding memory on it.
    pub processes: Vec<ProcessMemory>,
}

/// One process's memory on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProcessMemory {
    /// Process id (in the host's pid namespace).
    pub pid: u32,
    /// Used bytes; `None` when the driver does not say (e.g. some containers).
    pub used_bytes: Option<u64>,
}

/// A sample of every device.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct GpuSnapshot {
    /// The devices.
    pub devices: Vec<DeviceMemory>,
}

/// Where GPU memory figures come from.
pub trait GpuProbe: Send + Sync + 'static {
    /// Samples every device. Blocking (NVML calls are synchronous): run it off the
    /// async workers.
    fn sample(&self) -> Result<GpuSnapshot, String>;
}

/// The real probe.
pub struct NvmlProbe {
    nvml: nvml_wrapper::Nvml,
}

impl NvmlProbe {
    /// Loads and initialises NVML; the error says why it is unavailable.
    pub fn init() -> Result<NvmlProbe, String> {
        match nvml_wrapper::Nvml::init() {
            Ok(nvml) => Ok(NvmlProbe { nvml }),
            Err(e) => Err(format!("NVML init failed: {e}")),
        }
    }
}

impl GpuProbe for NvmlProbe {
    fn sample(&self) -> Result<GpuSnapshot, String> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let n = self
            .nvml
            .device_count()
            .map_err(|e| format!("NVML device count: {e}"))?;
        let mut devices = Vec::with_capacity(n as usize);
        for index in 0..n {
            let dev = self
                .nvml
                .device_by_index(index)
                .map_err(|e| format!("NVML device {index}: {e}"))?;
            let mem = dev
                .memory_info()
                .map_err(|e| format!("NVML device {index} memory: {e}"))?;
            let mut processes: Vec<ProcessMemory> = Vec::new();
            // Compute (CUDA) and graphics contexts; a process may appear in both.
            let procs = dev
                .running_compute_processes()
                .unwrap_or_default()
                .into_iter()
                .chain(dev.running_graphics_processes().unwrap_or_default());
            for p in procs {
                let used = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                };
                match processes.iter_mut().find(|q| q.pid == p.pid) {
                    Some(q) => q.used_bytes = q.used_bytes.max(used),
                    None => processes.push(ProcessMemory {
                        pid: p.pid,
                        used_bytes: used,
                    }),
                }
            }
            devices.push(DeviceMemory {
                index,
                name: dev.name().unwrap_or_default(),
                uuid: dev.uuid().unwrap_or_default(),
                total_bytes: mem.total,
                used_bytes: mem.used,
                free_bytes: mem.free,
                processes,
            });
        }
        Ok(GpuSnapshot { devices })
    }
}

/// What `/v1/gpu` shows and the metrics read.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GpuStatus {
    /// NVML loaded and the last sample succeeded.
    pub nvml_available: bool,
    /// Why not, when not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable_reason: Option<String>,
    /// Unix seconds of the last successful sample.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampled_at_unix: Option<u64>,
    /// The last successful sample's devices.
    pub devices: Vec<DeviceMemory>,
}

/// Folds probe results into a status, logging the first failure and recoveries once
/// (not every sample).
#[derive(Debug, Default)]
pub struct GpuTracker {
    status: GpuStatus,
    logged_failure: bool,
    /// Label sets last exported per device (kept to remove stale ones).
    pub exported_devices: std::collections::HashSet<Vec<(&'static str, String)>>,
    /// Label sets last exported per process.
    pub exported_processes: std::collections::HashSet<Vec<(&'static str, String)>>,
    /// When the last successful sample was folded in (quiet checkpoints).
    pub last_ok_at: Option<std::time::Instant>,
}

impl GpuTracker {
    /// A tracker whose probe could not even be opened.
    pub fn unavailable(reason: String) -> Self {
        tracing::warn!(reason = %reason, "NVML is unavailable; GPU memory figures will not be reported (kvguard_control_nvml_available 0); everything else keeps working");
        GpuTracker {
            status: GpuStatus {
                nvml_available: false,
                unavailable_reason: Some(reason),
                sampled_at_unix: None,
                devices: Vec::new(),
            },
            logged_failure: true,
            ..GpuTracker::default()
        }
    }

    /// Records one probe result.
    pub fn record(&mut self, result: Result<GpuSnapshot, String>, now_unix: u64) {
        match result {
            Ok(snap) => {
                if !self.status.nvml_available && self.logged_failure {
                    tracing::info!(devices = snap.devices.len(), "NVML is available again");
                }
                self.logged_failure = false;
                self.status = GpuStatus {
                    nvml_available: true,
                    unavailable_reason: None,
                    sampled_at_unix: Some(now_unix),
                    devices: snap.devices,
                };
            }
            Err(reason) => {
                if !self.logged_failure {
                    tracing::warn!(reason = %reason, "NVML sample failed; kvguard_control_nvml_available 0");
                    self.logged_failure = true;
                }
                self.status.nvml_available = false;
                self.status.unavailable_reason = Some(reason);
                self.status.devices.clear();
            }
        }
    }

    /// The current status.
    pub fn status(&self) -> &GpuStatus {
        &self.status
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeProbe;

    pub(crate) fn snap(used: u64) -> GpuSnapshot {
        GpuSnapshot {
            devices: vec![DeviceMemory {
                index: 0,
                name: "NVIDIA H200".into(),
                uuid: "GPU-1".into(),
                total_bytes: 1000,
                used_bytes: used,
                free_bytes: 1000 - used,
                processes: vec![ProcessMemory {
                    pid: 42,
                    used_bytes: Some(used),
                }],
            }],
        }
    }

    #[test]
    fn tracker_through_fake() {
        let probe = FakeProbe::new(vec![Ok(snap(100)), Err("gone".into()), Ok(snap(300))]);
        let mut t = GpuTracker::default();
        t.record(probe.sample(), 1);
        assert!(t.status().nvml_available);
        assert_eq!(t.status().devices[0].used_bytes, 100);
        t.record(probe.sample(), 2);
        assert!(!t.status().nvml_available);
        assert_eq!(t.status().unavailable_reason.as_deref(), Some("gone"));
        assert!(t.status().devices.is_empty());
        assert_eq!(t.status().sampled_at_unix, Some(1));
        t.record(probe.sample(), 3);
        assert!(t.status().nvml_available);
        assert_eq!(t.status().sampled_at_unix, Some(3));
        // The last answer repeats.
        assert_eq!(probe.sample().unwrap().devices[0].used_bytes, 300);
    }

    #[test]
    fn unavailable_from_start_serialises() {
        let t = GpuTracker::unavailable("NVML init failed: LibloadingError".into());
        let j = serde_json::to_value(t.status()).unwrap();
        assert_eq!(j["nvml_available"], false);
        assert_eq!(j["unavailable_reason"], "NVML init failed: LibloadingError");
    }

    /// What is wrong with a sample from a machine with a GPU, if anything: no device,
    /// indices out of order, a device without a name, uuid or memory, used or free above
    /// total, a process using more than its device has.
    fn insane(snap: &GpuSnapshot) -> Option<String> {
        if snap.devices.is_empty() {
            return Some("no device".into());
        }
        for (i, d) in snap.devices.iter().enumerate() {
            let bad = if d.index as usize != i {
                "index out of order"
            } else if d.name.trim().is_empty() {
                "no name"
            } else if d.uuid.trim().is_empty() {
                "no uuid"
            } else if d.total_bytes == 0 {
                "no memory"
            } else if d.used_bytes > d.total_bytes {
                "used > total"
            } else if d.free_bytes > d.total_bytes {
                "free > total"
            } else if d
                .processes
                .iter()
                .any(|p| p.used_bytes.unwrap_or(0) > d.total_bytes)
            {
                "process uses more than the device has"
            } else {
                continue;
            };
            return Some(format!("device {i}: {bad}"));
        }
        None
    }

    #[test]
    fn the_gpu_sanity_check_catches_broken_samples() {
        assert_eq!(insane(&snap(100)), None);
        type Breaker = fn(&mut GpuSnapshot);
        let breaks: [(Breaker, &str); 8] = [
            (|s| s.devices.clear(), "no device"),
            (|s| s.devices[0].index = 1, "index out of order"),
            (|s| s.devices[0].name.clear(), "no name"),
            (|s| s.devices[0].uuid = " ".into(), "no uuid"),
            (|s| s.devices[0].total_bytes = 0, "no memory"),
            (|s| s.devices[0].used_bytes = 1001, "used > total"),
            (|s| s.devices[0].free_bytes = 1001, "free > total"),
            (
                |s| s.devices[0].processes[0].used_bytes = Some(1001),
                "process uses more",
            ),
        ];
        for (brk, what) in breaks {
            let mut s = snap(100);
            brk(&mut s);
            let got = insane(&s);
            assert!(
                got.as_deref().is_some_and(|g| g.contains(what)),
                "{what}: {got:?}"
            );
        }
    }

    #[test]
    fn real_nvml_init_never_panics() {
        // On machines without a driver this is an Err with a reason; with one, Ok, and then
        // a sample must succeed and describe real devices.
        match NvmlProbe::init() {
            Ok(p) => {
                let snap = p.sample();
                eprintln!("NVML sample: {snap:?}");
                match snap {
                    Ok(s) => assert_eq!(insane(&s), None, "{s:?}"),
                    Err(e) => panic!("NVML initialised but the sample failed: {e}"),
                }
            }
            // The reason carries NVML's own error after the prefix.
            Err(reason) => assert!(
                reason
                    .strip_prefix("NVML init failed: ")
                    .is_some_and(|e| !e.trim().is_empty()),
                "{reason}"
            ),
        }
    }
}
