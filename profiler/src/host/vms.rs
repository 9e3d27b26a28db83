//! Which processes on the host are VMs, and which VM an invalidated range
//! of host virtual addresses belongs to.
//!
//! kvm_unmap_hva_range carries a host virtual address range, not the VM:
//! the task running is kcompactd or whoever compacts. A range is
//! attributed to the VM process (the VMM) whose memory map holds it. Two
//! VMMs can map the same addresses (separate address spaces); such ranges
//! are reported as ambiguous, never guessed.

use std::collections::BTreeMap;

use symbolizer::maps::ProcessMaps;

use super::analysis::VmInfo;

/// A VM process and its memory map (merged over the session, so a range
/// unmapped since the last look is still found).
pub struct Vmm {
    pub info: VmInfo,
    maps: ProcessMaps,
}

/// Where a range landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attribution {
    Vm(u32),
    /// Several VM processes map these addresses.
    Ambiguous(Vec<u32>),
    /// No known VM process maps them.
    Unknown,
}

/// The VM processes slotprof watches.
#[derive(Default)]
pub struct Vmms {
    pub vmms: BTreeMap<u32, Vmm>,
    /// `--vm-pid`: only these, when given.
    only: Vec<u32>,
}

impl Vmms {
    pub fn new(only: Vec<u32>) -> Self {
        Self {
            vmms: BTreeMap::new(),
            only,
        }
    }

    /// Finds VM processes (or re-reads the given ones) and refreshes their
    /// maps and memory figures. Returns the pids seen for the first time.
    pub fn refresh(&mut self) -> Vec<u32> {
        let pids = if self.only.is_empty() {
            find_vm_processes()
        } else {
            self.only.clone()
        };
        let mut new = Vec::new();
        for pid in pids {
            let Ok(maps) = ProcessMaps::read(pid) else {
                continue;
            };
            let (locked_kib, size_kib) = status_kib(pid);
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|s| s.trim().to_string())
                .unwrap_or_default();
            match self.vmms.get_mut(&pid) {
                Some(v) => {
                    v.maps.merge(maps);
                    // Keep the last figures a process that has exited had.
                    v.info.locked_kib = locked_kib.or(v.info.locked_kib);
                    v.info.size_kib = size_kib.or(v.info.size_kib);
                }
                None => {
                    new.push(pid);
                    self.vmms.insert(
                        pid,
                        Vmm {
                            info: VmInfo {
                                pid,
                                comm,
                                locked_kib,
                                size_kib,
                            },
                            maps,
                        },
                    );
                }
            }
        }
        new
    }

    /// The VM whose memory holds `[start, end)`.
    pub fn attribute(&self, start: u64, end: u64) -> Attribution {
        let last = end.max(start + 1) - 1;
        let holders: Vec<u32> = self
            .vmms
            .iter()
            .filter(|(_, v)| v.maps.find(start).is_some() || v.maps.find(last).is_some())
            .map(|(&pid, _)| pid)
            .collect();
        match holders.len() {
            0 => Attribution::Unknown,
            1 => Attribution::Vm(holders[0]),
            _ => Attribution::Ambiguous(holders),
        }
    }
}

/// Processes holding a KVM VM file descriptor (`anon_inode:kvm-vm`).
pub fn find_vm_processes() -> Vec<u32> {
    let Ok(proc) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = proc
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| holds_kvm_vm(*pid))
        .collect();
    pids.sort_unstable();
    pids
}

fn holds_kvm_vm(pid: u32) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.filter_map(Result::ok)
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target.as_os_str() == "anon_inode:kvm-vm"))
}

/// VmLck and VmSize of a process, in kB.
fn status_kib(pid: u32) -> (Option<u64>, Option<u64>) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    (status_field(&text, "VmLck:"), status_field(&text, "VmSize:"))
}

pub fn status_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmm(pid: u32, maps: &str) -> Vmm {
        Vmm {
            info: VmInfo {
                pid,
                ..Default::default()
            },
            maps: ProcessMaps::from_text(maps),
        }
    }

    #[test]
    fn attributes_by_map_and_says_when_ambiguous() {
        let mut v = Vmms::new(Vec::new());
        v.vmms
            .insert(10, vmm(10, "7f0000000000-7f0040000000 rw-p 00000000 00:00 0 \n"));
        v.vmms.insert(20, vmm(20, "7e0000000000-7e0040000000 rw-p 00000000 00:00 0 \n7f0000001000-7f0000002000 rw-p 00000000 00:00 0 \n"));
        assert_eq!(v.attribute(0x7e0000010000, 0x7e0000011000), Attribution::Vm(20));
        assert_eq!(v.attribute(0x7f0000100000, 0x7f0000101000), Attribution::Vm(10));
        assert_eq!(
            v.attribute(0x7f0000001000, 0x7f0000002000),
            Attribution::Ambiguous(vec![10, 20])
        );
        assert_eq!(v.attribute(0x1000, 0x2000), Attribution::Unknown);
    }

    #[test]
    fn reads_status_fields() {
        let t = "Name:\tfc\nVmLck:\t 1048576 kB\nVmSize:\t 2097152 kB\n";
        assert_eq!(status_field(t, "VmLck:"), Some(1 << 20));
        assert_eq!(status_field(t, "VmSize:"), Some(2 << 20));
        assert_eq!(status_field(t, "VmPin:"), None);
    }

    #[test]
    fn finds_no_vm_in_a_process_without_kvm() {
        assert!(!holds_kvm_vm(std::process::id()));
    }
}
