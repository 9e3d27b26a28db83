//! Just enough of the kernel's BTF (`/sys/kernel/btf/vmlinux`) to find
//! where a struct's members are: the sched_switch program reads the next
//! task's pid and comm through the task pointer its BTF tracepoint gets,
//! and `task_struct` moves between kernels and configurations.
//!
//! The format (Documentation/bpf/btf.rst): a header, a type section of
//! variable-length records (type ids count from 1 in order), and a string
//! section. The file is the kernel's, but it is still read as untrusted
//! input: every length and offset is checked.

use anyhow::{bail, Context};

const MAGIC: u16 = 0xeb9f;

/// BTF kinds (the `info` word's bits 24-28) and the bytes that follow
/// each record's 12-byte common part.
fn extra_bytes(kind: u32, vlen: usize) -> anyhow::Result<usize> {
    Ok(match kind {
        1 => 4,                    // INT
        2 | 7..=12 | 16 | 18 => 0, // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG
        3 => 12,                   // ARRAY
        4 | 5 => 12 * vlen,        // STRUCT, UNION: members
        6 => 8 * vlen,             // ENUM
        13 => 8 * vlen,            // FUNC_PROTO: params
        14 => 4,                   // VAR
        15 => 12 * vlen,           // DATASEC
        17 => 4,                   // DECL_TAG
        19 => 12 * vlen,           // ENUM64
        k => bail!("unknown BTF kind {k} (a newer kernel's BTF?)"),
    })
}

/// The byte offsets of `members` in the struct named `name` (its first
/// complete definition), in the order asked. Only whole, byte-aligned
/// members at the struct's own level are found (not inside anonymous
/// unions), which is where the fields slotprof reads are.
pub fn member_offsets(data: &[u8], name: &str, members: &[&str]) -> anyhow::Result<Vec<u32>> {
    let u16_at = |o: usize| -> anyhow::Result<u16> {
        Ok(u16::from_le_bytes(
            data.get(o..o + 2).context("BTF truncated")?.try_into()?,
        ))
    };
    let u32_at = |o: usize| -> anyhow::Result<u32> {
        Ok(u32::from_le_bytes(
            data.get(o..o + 4).context("BTF truncated")?.try_into()?,
        ))
    };
    if u16_at(0)? != MAGIC {
        bail!("not BTF (or not little-endian): bad magic");
    }
    let hdr_len = u32_at(4)? as usize;
    let (type_off, type_len) = (u32_at(8)? as usize, u32_at(12)? as usize);
    let (str_off, str_len) = (u32_at(16)? as usize, u32_at(20)? as usize);
    let section = |off: usize, len: usize| {
        hdr_len
            .checked_add(off)
            .and_then(|s| Some((s, s.checked_add(len)?)))
            .filter(|&(_, e)| e <= data.len())
            .context("BTF section out of bounds")
    };
    let (types, types_end) = section(type_off, type_len)?;
    let (strings, strings_end) = section(str_off, str_len)?;
    let string = |off: u32| -> Option<&[u8]> {
        let s = data.get(strings + off as usize..strings_end)?;
        Some(&s[..s.iter().position(|&b| b == 0)?])
    };

    let mut at = types;
    while at < types_end {
        let name_off = u32_at(at)?;
        let info = u32_at(at + 4)?;
        let kind = (info >> 24) & 0x1f;
        let vlen = (info & 0xffff) as usize;
        let kind_flag = info >> 31 != 0;
        let extra = extra_bytes(kind, vlen)?;
        let body = at + 12;
        if body + extra > types_end {
            bail!("BTF type record runs past its section");
        }
        if kind == 4 && vlen > 0 && string(name_off) == Some(name.as_bytes()) {
            let mut found = vec![None; members.len()];
            for m in 0..vlen {
                let rec = body + 12 * m;
                let Some(mname) = string(u32_at(rec)?) else {
                    continue;
                };
                let mut bits = u32_at(rec + 8)?;
                if kind_flag {
                    if bits >> 24 != 0 {
                        continue; // a bitfield
                    }
                    bits &= 0x00ff_ffff;
                }
                if let Some(i) = members.iter().position(|w| w.as_bytes() == mname) {
                    if bits % 8 == 0 {
                        found[i] = Some(bits / 8);
                    }
                }
            }
            return members
                .iter()
                .zip(found)
                .map(|(m, f)| {
                    f.with_context(|| format!("struct {name} has no member {m} in this kernel's BTF"))
                })
                .collect();
        }
        at = body + extra;
    }
    bail!("no struct {name} in this kernel's BTF")
}

/// Where `pid`, `comm`, `flags` and `tgid` are in this kernel's `task_struct`.
pub fn task_offsets() -> anyhow::Result<[u32; 4]> {
    let path = "/sys/kernel/btf/vmlinux";
    let data = std::fs::read(path).with_context(|| {
        format!("cannot read {path}: slotprof needs a kernel with BTF (CONFIG_DEBUG_INFO_BTF=y)")
    })?;
    let o = member_offsets(&data, "task_struct", &["pid", "comm", "flags", "tgid"])
        .with_context(|| format!("reading {path}"))?;
    Ok([o[0], o[1], o[2], o[3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob with: 1 INT "int", 2 STRUCT "other" {pid@0},
    /// 3 FWD "task_struct", 4 STRUCT "task_struct" {x@0, pid@64 bits,
    /// flags bitfield, comm@128 bits}.
    fn blob() -> Vec<u8> {
        let strings = b"\0int\0other\0task_struct\0pid\0x\0comm\0flags\0";
        let s = |name: &str| {
            let needle = [name.as_bytes(), b"\0"].concat();
            strings
                .windows(needle.len())
                .enumerate()
                .find(|(i, w)| *w == needle.as_slice() && strings[i - 1] == 0)
                .unwrap()
                .0 as u32
        };
        let mut t = Vec::new();
        let mut rec = |words: &[u32]| words.iter().for_each(|w| t.extend_from_slice(&w.to_le_bytes()));
        rec(&[s("int"), 1 << 24, 4, 32]);
        rec(&[s("other"), (4 << 24) | 1, 4, s("pid"), 1, 0]);
        rec(&[s("task_struct"), 7 << 24, 0]);
        rec(&[s("task_struct"), (4 << 24) | (1 << 31) | 4, 32]);
        rec(&[s("x"), 1, 0]);
        rec(&[s("pid"), 1, 64]);
        rec(&[s("flags"), 1, (3 << 24) | 96]);
        rec(&[s("comm"), 1, 128]);
        let mut b = Vec::new();
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.extend_from_slice(&[1, 0]);
        for w in [24u32, 0, t.len() as u32, t.len() as u32, strings.len() as u32] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        b.extend_from_slice(&t);
        b.extend_from_slice(strings);
        b
    }

    #[test]
    fn finds_members_of_the_complete_struct() {
        assert_eq!(
            member_offsets(&blob(), "task_struct", &["comm", "pid"]).unwrap(),
            [16, 8]
        );
        assert_eq!(member_offsets(&blob(), "other", &["pid"]).unwrap(), [0]);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let b = blob();
        assert!(member_offsets(&b, "task_struct", &["flags"]).is_err(), "bitfield");
        assert!(member_offsets(&b, "nope", &["pid"]).is_err());
        for cut in 0..b.len() {
            let _ = member_offsets(&b[..cut], "task_struct", &["pid"]);
        }
        let mut bad = b.clone();
        bad[0] = 0;
        assert!(member_offsets(&bad, "task_struct", &["pid"]).is_err());
        let mut huge = b.clone();
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(member_offsets(&huge, "task_struct", &["pid"]).is_err());
    }

    #[test]
    fn this_kernels_task_struct() {
        let Ok(data) = std::fs::read("/sys/kernel/btf/vmlinux") else {
            eprintln!("SKIPPED: no /sys/kernel/btf/vmlinux");
            return;
        };
        let o = member_offsets(&data, "task_struct", &["pid", "tgid", "comm"]).unwrap();
        // pid_t pid; pid_t tgid; are adjacent everywhere.
        assert_eq!(o[1], o[0] + 4, "{o:?}");
        assert!(o[2] > o[1], "{o:?}");
    }
}
