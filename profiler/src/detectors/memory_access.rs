//! Which memory a sampled instruction touched, without a PMU.
//!
//! For each cpu-clock sample taken in user mode we have the registers. We
//! decode the target's code (read from its file) from the start of the
//! sampled function forwards, to find the instruction at the sampled IP and
//! the one that ended just before it (a timer interrupt lands after the
//! instruction that was stalling, so the culprit is often the previous
//! one), and compute their memory operands' effective addresses from the
//! registers.
//!
//! What this can and cannot see: only instructions that were being
//! executed when the timer fired, so cost shows in proportion to the time
//! spent, and short runs give few samples; loads that hit in cache rarely
//! show; for the previous instruction the registers are those after it ran,
//! so one that overwrote its own address registers is skipped; code not
//! backed by a file (JIT) is skipped.

use std::collections::HashMap;

use iced_x86::{Decoder, DecoderOptions, Instruction, InstructionInfoFactory, Mnemonic, OpAccess, Register};
use profiler_ebpf::{reg, UserRegs};
use serde::{Deserialize, Serialize};
use symbolizer::Symbolizer;

/// How an instruction touched memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum AccessKind {
    /// A locked read-modify-write (`lock add`, `lock cmpxchg`, `xchg`):
    /// what a lock or an atomic counter does.
    AtomicRmw,
    /// A plain read-modify-write (`add [m], r`).
    Rmw,
    Load,
    Store,
}

impl AccessKind {
    pub fn writes(self) -> bool {
        !matches!(self, AccessKind::Load)
    }
}

/// One memory access attributed to a sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryAccess {
    pub ts_ns: u64,
    pub tid: u32,
    pub cpu: u32,
    /// Address of the instruction.
    pub ip: u64,
    /// Effective address of its memory operand.
    pub addr: u64,
    pub kind: AccessKind,
}

/// How far back from a sampled IP decoding starts when the function start
/// is unknown is not guessed: such samples are skipped.
const MAX_FUNCTION_BYTES: u64 = 1 << 16;

/// Value of a 64-bit general register in a sample (sub-registers read
/// their full register; segment bases other than zero are not known).
fn register_value(regs: &[u64], r: Register, next_ip: u64) -> Option<u64> {
    let full = r.full_register();
    let v = match full {
        Register::RAX => regs[reg::RAX],
        Register::RBX => regs[reg::RBX],
        Register::RCX => regs[reg::RCX],
        Register::RDX => regs[reg::RDX],
        Register::RSI => regs[reg::RSI],
        Register::RDI => regs[reg::RDI],
        Register::RBP => regs[reg::RBP],
        Register::RSP => regs[reg::RSP],
        Register::R8 => regs[reg::R8],
        Register::R9 => regs[reg::R9],
        Register::R10 => regs[reg::R10],
        Register::R11 => regs[reg::R11],
        Register::R12 => regs[reg::R12],
        Register::R13 => regs[reg::R13],
        Register::R14 => regs[reg::R14],
        Register::R15 => regs[reg::R15],
        Register::RIP => next_ip,
        Register::ES | Register::CS | Register::SS | Register::DS => 0,
        _ => return None,
    };
    // 32-bit sub-registers (EAX) zero-extend; narrower ones are not used
    // for addressing in 64-bit code.
    Some(if r.size() == 4 { v & 0xffff_ffff } else { v })
}

/// The memory accesses of one decoded instruction, given the registers.
/// `executed`: the registers are those after it ran.
fn accesses_of(
    instr: &Instruction,
    regs: &[u64],
    executed: bool,
    info: &mut InstructionInfoFactory,
) -> Vec<(u64, AccessKind)> {
    let info = info.info(instr);
    if executed {
        // If it wrote a register its address depends on, the address
        // computed now would be wrong.
        let addr_regs = [
            instr.memory_base().full_register(),
            instr.memory_index().full_register(),
        ];
        let clobbered = info.used_registers().iter().any(|u| {
            matches!(
                u.access(),
                OpAccess::Write | OpAccess::ReadWrite | OpAccess::CondWrite | OpAccess::ReadCondWrite
            ) && addr_regs.contains(&u.register().full_register())
                && u.register() != Register::None
        });
        if clobbered {
            return Vec::new();
        }
    }
    let locked = instr.has_lock_prefix() || instr.mnemonic() == Mnemonic::Xchg;
    info.used_memory()
        .iter()
        .filter(|m| m.segment() != Register::FS && m.segment() != Register::GS)
        .filter(|m| m.base() != Register::RSP || m.index() != Register::None) // pushes/pops: the stack
        .filter_map(|m| {
            let addr = m.virtual_address(0, |r, _, _| register_value(regs, r, instr.next_ip()))?;
            let kind = match m.access() {
                OpAccess::ReadWrite | OpAccess::ReadCondWrite if locked => AccessKind::AtomicRmw,
                OpAccess::ReadWrite | OpAccess::ReadCondWrite => AccessKind::Rmw,
                OpAccess::Write | OpAccess::CondWrite => AccessKind::Store,
                OpAccess::Read | OpAccess::CondRead => AccessKind::Load,
                _ => return None,
            };
            Some((addr, kind))
        })
        .collect()
}

/// The instruction at `ip` and the one ending at `ip`, decoding `code`
/// (which starts at `start`) from the beginning.
fn around(code: &[u8], start: u64, ip: u64) -> (Option<Instruction>, Option<Instruction>) {
    let mut decoder = Decoder::with_ip(64, code, start, DecoderOptions::NONE);
    let mut prev = None;
    while decoder.can_decode() {
        let i = decoder.decode();
        if i.ip() == ip {
            return (Some(i), prev.filter(|p: &Instruction| p.next_ip() == ip));
        }
        if i.ip() > ip {
            break;
        }
        prev = Some(i);
    }
    (None, prev.filter(|p| p.next_ip() == ip))
}

/// Why samples gave no memory access (summary.json's `cache_lines`: a
/// detector that sees nothing says why).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DecodeStats {
    /// Samples whose function start is not known (no symbol: stripped
    /// code, JIT, or a process whose map was never read).
    pub no_function: u64,
    /// Samples whose code could not be read from its file.
    pub no_code: u64,
    /// Samples where neither the instruction at the IP nor the one before
    /// it touched memory (or its address could not be computed).
    pub no_memory_operand: u64,
    /// Samples that gave at least one access.
    pub decoded: u64,
    /// The sampled instructions that most often gave none
    /// (`module+0xoffset`, samples), at most five.
    pub most_undecoded: Vec<(String, u64)>,
}

/// Decodes every user-mode sample into the memory accesses it shows.
pub fn decode(samples: &[UserRegs], sym: &mut Symbolizer) -> (Vec<MemoryAccess>, DecodeStats) {
    let mut stats = DecodeStats::default();
    let mut info = InstructionInfoFactory::new();
    let mut starts: HashMap<(u32, u64), Option<u64>> = HashMap::new();
    let mut code: HashMap<(u32, u64), Option<Vec<u8>>> = HashMap::new();
    let mut out = Vec::new();
    let mut undecoded: HashMap<(u32, u64), u64> = HashMap::new();
    for s in samples {
        let ip = s.regs[reg::RIP];
        let Some(start) = *starts
            .entry((s.tgid, ip))
            .or_insert_with(|| sym.function_start(s.tgid, ip))
        else {
            stats.no_function += 1;
            *undecoded.entry((s.tgid, ip)).or_default() += 1;
            continue;
        };
        if ip - start > MAX_FUNCTION_BYTES {
            stats.no_function += 1;
            *undecoded.entry((s.tgid, ip)).or_default() += 1;
            continue;
        }
        let need = (ip - start) as usize + 16;
        let bytes = code.entry((s.tgid, start)).or_insert(None);
        if bytes.as_ref().is_none_or(|b| b.len() < need) {
            *bytes = sym.code_at(s.tgid, start, need.max(4096));
        }
        let Some(bytes) = bytes.as_deref() else {
            stats.no_code += 1;
            *undecoded.entry((s.tgid, ip)).or_default() += 1;
            continue;
        };
        let (at, before) = around(bytes, start, ip);
        let found = out.len();
        for (instr, executed) in [(at, false), (before, true)] {
            let Some(instr) = instr else { continue };
            for (addr, kind) in accesses_of(&instr, &s.regs, executed, &mut info) {
                out.push(MemoryAccess {
                    ts_ns: s.ts_ns,
                    tid: s.tid,
                    cpu: s.cpu,
                    ip: instr.ip(),
                    addr,
                    kind,
                });
            }
        }
        if out.len() > found {
            stats.decoded += 1;
        } else {
            stats.no_memory_operand += 1;
            *undecoded.entry((s.tgid, ip)).or_default() += 1;
        }
    }
    let mut top: Vec<((u32, u64), u64)> = undecoded.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    stats.most_undecoded = top
        .into_iter()
        .take(5)
        .map(|((pid, ip), n)| (sym.module_offset(pid, ip, false), n))
        .collect();
    (out, stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn regs_with(pairs: &[(usize, u64)]) -> Vec<u64> {
        let mut r = vec![0u64; profiler_ebpf::PT_REGS_WORDS];
        for &(i, v) in pairs {
            r[i] = v;
        }
        r
    }

    #[test]
    fn locked_adds_loads_and_rip_relative_operands() {
        // lock add qword [rdi+8], 1 ; mov rax, [rsi+rcx*8+16] ; lock xadd [rip+0x100], rax ; ret
        let code = [
            0xf0, 0x48, 0x83, 0x47, 0x08, 0x01, // lock add qword [rdi+8], 1
            0x48, 0x8b, 0x44, 0xce, 0x10, // mov rax, [rsi+rcx*8+16]
            0xf0, 0x48, 0x0f, 0xc1, 0x05, 0x00, 0x01, 0x00, 0x00, // lock xadd [rip+0x100], rax
            0xc3,
        ];
        let start = 0x40_0000;
        let mut f = InstructionInfoFactory::new();
        let regs = regs_with(&[(reg::RDI, 0x1000), (reg::RSI, 0x2000), (reg::RCX, 3)]);
        let (at, before) = around(&code, start, start + 6);
        assert_eq!(
            accesses_of(&at.unwrap(), &regs, false, &mut f),
            [(0x2000 + 24 + 16, AccessKind::Load)]
        );
        assert_eq!(
            accesses_of(&before.unwrap(), &regs, true, &mut f),
            [(0x1008, AccessKind::AtomicRmw)]
        );
        let (at, _) = around(&code, start, start + 11);
        let next = start + 20;
        assert_eq!(
            accesses_of(&at.unwrap(), &regs, false, &mut f),
            [(next + 0x100, AccessKind::AtomicRmw)]
        );
    }

    #[test]
    fn an_executed_load_into_its_own_base_register_is_skipped() {
        // mov rax, [rax+8] ; nop
        let code = [0x48, 0x8b, 0x40, 0x08, 0x90];
        let mut f = InstructionInfoFactory::new();
        let regs = regs_with(&[(reg::RAX, 0x5000)]);
        let (_, before) = around(&code, 0x1000, 0x1004);
        assert!(accesses_of(&before.unwrap(), &regs, true, &mut f).is_empty());
        let (at, _) = around(&code, 0x1000, 0x1000);
        assert_eq!(
            accesses_of(&at.unwrap(), &regs, false, &mut f),
            [(0x5008, AccessKind::Load)]
        );
    }
}
