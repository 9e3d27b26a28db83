//! Stacks read from the kernel's stack maps, kept past the map's epoch
//! while events or sleeping threads still refer to them.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use profiler_ebpf::{split_stack_id, STACK_EPOCH_MASK};

use crate::kernel::probes::{Probes, StackTable};

/// Stacks read from the kernel, kept while events or sleeping threads may
/// still refer to them (the kernel's copy is gone two epochs later). Used
/// with [`Probes::next_stack_epoch`] by every mode: a map that only ever
/// holds the last two epochs' stacks has few hash collisions (a collision
/// loses the stack: the kernel's stack map has one entry per bucket).
#[derive(Default)]
pub struct StackCache {
    /// User stacks unwound from copies (ids from `USER_STACK_ID_BASE` up).
    pub user: crate::kernel::user_stacks::UserStacks,
    stacks: HashMap<i32, (Vec<u64>, u64)>,
    generation: u64,
    rotated: Option<Instant>,
}

/// The stack maps take turns at most this often: a map is emptied only
/// when it has not been written for at least this long, so no record a
/// program is still writing refers to it.
const STACK_EPOCH_MIN: Duration = Duration::from_millis(200);

impl StackCache {
    /// The stacks of `ids`, from the cache or the kernel.
    pub fn table(&mut self, probes: &Probes, ids: impl IntoIterator<Item = i32>) -> StackTable {
        self.generation += 1;
        let g = self.generation;
        let mut table = StackTable::new();
        for id in ids {
            if let Some(s) = self.read(probes, id) {
                table.insert(id, s);
            }
        }
        self.stacks.retain(|_, (_, used)| g - *used < 25);
        table
    }

    fn read(&mut self, probes: &Probes, id: i32) -> Option<Vec<u64>> {
        if crate::kernel::user_stacks::is_unwound(id) {
            return self.user.get(id);
        }
        if let Some((s, used)) = self.stacks.get_mut(&id) {
            *used = self.generation;
            return Some(s.clone());
        }
        let s = probes.stack(id)?;
        self.stacks.insert(id, (s.clone(), self.generation));
        Some(s)
    }

    /// Starts a new stack epoch (which empties the older of the two maps),
    /// first copying the stacks that `still_needed` (events not processed
    /// yet, threads off-CPU now) refers to. Returns the stacks emptied.
    pub fn rotate(
        &mut self,
        probes: &mut Probes,
        still_needed: impl IntoIterator<Item = i32>,
    ) -> anyhow::Result<usize> {
        if self.rotated.is_some_and(|t| t.elapsed() < STACK_EPOCH_MIN) {
            return Ok(0);
        }
        let doomed = probes.stack_epoch().wrapping_sub(1) & STACK_EPOCH_MASK;
        for id in still_needed
            .into_iter()
            .filter(|&id| id >= 0 && !crate::kernel::user_stacks::is_unwound(id))
        {
            if let Some((_, used)) = self.stacks.get_mut(&id) {
                *used = self.generation;
            } else if split_stack_id(id).0 == doomed {
                let _ = self.read(probes, id);
            }
        }
        self.rotated = Some(Instant::now());
        probes.next_stack_epoch()
    }
}
