//! tracefs: where it is, and where tracepoint fields sit on this kernel.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// The tracefs root, mounting it at /sys/kernel/tracing when no tracefs is
/// mounted (aya needs it to find tracepoint ids; it is a view of kernel
/// state, mounting it changes no setting).
pub fn ensure_mounted() -> anyhow::Result<PathBuf> {
    for dir in ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"] {
        if Path::new(dir).join("events").is_dir() {
            return Ok(PathBuf::from(dir));
        }
    }
    if let Err(err) = crate::sys::mount_tracefs() {
        bail!(
            "tracefs is not mounted and mounting it failed ({err}): \
             run `mount -t tracefs nodev /sys/kernel/tracing` and try again"
        );
    }
    Ok(PathBuf::from("/sys/kernel/tracing"))
}

/// A field of a tracepoint's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    pub offset: u32,
    pub size: u32,
}

/// The fields of one tracepoint, from its `format` file.
#[derive(Clone, Debug, Default)]
pub struct Format {
    fields: Vec<(String, Field)>,
}

impl Format {
    /// Reads `events/CATEGORY/NAME/format` under `tracefs`.
    pub fn read(tracefs: &Path, category: &str, name: &str) -> anyhow::Result<Self> {
        let path = tracefs.join("events").join(category).join(name).join("format");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("tracepoint {category}:{name} not found ({})", path.display()))?;
        Ok(Self::parse(&text))
    }

    /// Parses the text of a `format` file.
    pub fn parse(text: &str) -> Self {
        let mut fields = Vec::new();
        for line in text.lines() {
            let line = line.trim();
            let Some(rest) = line.strip_prefix("field:") else {
                continue;
            };
            let mut parts = rest.split(';').map(str::trim);
            let Some(decl) = parts.next() else { continue };
            let mut offset = None;
            let mut size = None;
            for p in parts {
                if let Some(v) = p.strip_prefix("offset:") {
                    offset = v.parse().ok();
                } else if let Some(v) = p.strip_prefix("size:") {
                    size = v.parse().ok();
                }
            }
            // "char prev_comm[16]" -> "prev_comm"
            let name = decl.rsplit(' ').next().unwrap_or(decl);
            let name = name.split('[').next().unwrap_or(name).to_string();
            if let (Some(offset), Some(size)) = (offset, size) {
                fields.push((name, Field { offset, size }));
            }
        }
        Self { fields }
    }

    /// The field called `name`, which must be `size` bytes.
    pub fn field(&self, name: &str, size: u32) -> anyhow::Result<Field> {
        let Some((_, f)) = self.fields.iter().find(|(n, _)| n == name) else {
            bail!("this kernel's tracepoint has no field `{name}`");
        };
        if f.size != size {
            bail!(
                "field `{name}` is {} bytes on this kernel, slotprof reads {size}",
                f.size
            );
        }
        Ok(*f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // As printed by Linux 6.x.
    const SCHED_SWITCH: &str = "name: sched_switch
ID: 316
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:char prev_comm[16];\toffset:8;\tsize:16;\tsigned:0;
\tfield:pid_t prev_pid;\toffset:24;\tsize:4;\tsigned:1;
\tfield:int prev_prio;\toffset:28;\tsize:4;\tsigned:1;
\tfield:long prev_state;\toffset:32;\tsize:8;\tsigned:1;
\tfield:char next_comm[16];\toffset:40;\tsize:16;\tsigned:0;
\tfield:pid_t next_pid;\toffset:56;\tsize:4;\tsigned:1;
\tfield:int next_prio;\toffset:60;\tsize:4;\tsigned:1;

print fmt: \"prev_comm=%s\"
";

    #[test]
    fn finds_fields_and_checks_sizes() {
        let f = Format::parse(SCHED_SWITCH);
        assert_eq!(f.field("prev_pid", 4).unwrap().offset, 24);
        assert_eq!(f.field("prev_state", 8).unwrap().offset, 32);
        assert_eq!(f.field("next_comm", 16).unwrap().offset, 40);
        assert_eq!(f.field("next_pid", 4).unwrap().offset, 56);
        assert!(f.field("prev_state", 4).is_err());
        assert!(f.field("nope", 4).unwrap_err().to_string().contains("nope"));
    }
}
