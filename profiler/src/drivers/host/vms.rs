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

use crate::detectors::kvm_mmu_invalidation::{analysis::VmInfo, Attribution};

/// A VM process and its memory map (merged over the session, so a range
/// unmapped since the last look is still found).
pub struct Vmm {
    pub info: VmInfo,
    maps: ProcessMaps,
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
            1 => {
                let maps = &self.vmms[&holders[0]].maps;
                let guest = [start, last]
                    .iter()
                    .any(|&a| maps.find(a).is_some_and(is_guest_memory));
                if guest {
                    Attribution::Vm(holders[0])
                } else {
                    Attribution::VmmOwn(holders[0])
                }
            }
            _ => Attribution::Ambiguous(holders),
        }
    }
}

/// Guest memory is one large mapping (QEMU, Firecracker and cloud-hypervisor
/// map each RAM region whole: anonymous, memfd, hugetlbfs or a file on
/// tmpfs); below this a mapping is the VMM's own.
pub const MIN_GUEST_MAPPING_BYTES: u64 = 128 << 20;

/// Whether a mapping of a VM process can hold guest RAM: not code, not a
/// pseudo mapping (`[heap]`, `[stack]`), and at least
/// [`MIN_GUEST_MAPPING_BYTES`] long. The MMU notifier fires for every
/// range of the process that the kernel unmaps or migrates, but KVM zaps
/// guest mappings only where a memslot covers the range; measured on the
/// test guest with compaction of locked memory off: 1,973 invalidations,
/// all in its heap, small anonymous buffers and libc/its own text, none in
/// the 1 GiB of guest RAM.
fn is_guest_memory(m: &symbolizer::maps::Mapping) -> bool {
    !m.executable && (m.path.is_some() || m.label == "[anon]") && m.end - m.start >= MIN_GUEST_MAPPING_BYTES
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
    fn the_vmms_own_heap_stack_and_code_are_not_guest_memory() {
        let mut v = Vmms::new(Vec::new());
        v.vmms.insert(
            10,
            vmm(
                10,
                "555500000000-555500001000 r-xp 00000000 08:01 12 /usr/bin/qemu\n\
                 555500100000-555500700000 rw-p 00000000 00:00 0 [heap]\n\
                 7f0000000000-7f0040000000 rw-p 00000000 00:00 0 \n\
                 7f1000000000-7f1000200000 rw-p 00000000 00:00 0 \n\
                 7f2000000000-7f2040000000 rw-s 00000000 00:01 7 /memfd:pc.ram (deleted)\n\
                 7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]\n",
            ),
        );
        assert_eq!(v.attribute(0x7f0000100000, 0x7f0000101000), Attribution::Vm(10));
        assert_eq!(v.attribute(0x7f2000100000, 0x7f2000101000), Attribution::Vm(10));
        for own in [0x555500000000, 0x555500200000, 0x7f1000001000, 0x7ffd00001000] {
            assert_eq!(
                v.attribute(own, own + 0x1000),
                Attribution::VmmOwn(10),
                "{own:#x}"
            );
        }
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
