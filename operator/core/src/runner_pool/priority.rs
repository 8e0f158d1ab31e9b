//! Whether a pool may use the PriorityClass it names. A RunnerPool is namespaced, but a
//! PriorityClass decides whom the scheduler preempts cluster-wide: the installer sets a
//! ceiling (`runnerPool.maxPriority`), and a pool that creates or references a class
//! above it, or a reserved `system-*` class, gets no DaemonSet.

use podmotion_api::RunnerPool;

/// The installer's ceiling when none is configured: the default class's own value.
pub const DEFAULT_CEILING: i32 = 1_000_000;

/// What the cluster says about the class a pool references (`priorityClass.create:
/// false`): its value, or that it does not exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Referenced {
    /// The pool creates its class: nothing was read.
    NotRead,
    Missing,
    Value(i32),
}

/// `Err(why)` when `pool` may not use its PriorityClass under `ceiling`.
pub fn check(pool: &RunnerPool, ceiling: i32, referenced: Referenced) -> Result<(), String> {
    let pc = &pool.spec.priority_class;
    if pc.name.starts_with("system-") {
        return Err(format!(
            "PriorityClass {} is reserved for the cluster's own components",
            pc.name
        ));
    }
    let value = if pc.create {
        pc.value
    } else {
        match referenced {
            Referenced::Value(v) => v,
            Referenced::Missing => {
                return Err(format!(
                    "PriorityClass {} does not exist (priorityClass.create is false)",
                    pc.name
                ));
            }
            // Not read: the controller reads every referenced class; refuse rather
            // than guess.
            Referenced::NotRead => {
                return Err(format!("PriorityClass {} was not read", pc.name));
            }
        }
    };
    if value > ceiling {
        return Err(format!(
            "PriorityClass {} has value {value}, above {ceiling}, the most the operator's installer allows RunnerPools (chart value runnerPool.maxPriority)",
            pc.name
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner_pool::fixtures::pool;

    #[test]
    fn the_default_class_is_allowed_under_the_default_ceiling() {
        assert_eq!(
            check(
                &pool("runners").build(),
                DEFAULT_CEILING,
                Referenced::NotRead
            ),
            Ok(())
        );
    }

    #[test]
    fn a_created_class_above_the_ceiling_is_refused() {
        let mut p = pool("runners").build();
        p.spec.priority_class.value = 999_999_999;
        let why = check(&p, DEFAULT_CEILING, Referenced::NotRead).unwrap_err();
        assert!(
            why.contains("999999999") && why.contains("runnerPool.maxPriority"),
            "{why}"
        );
        assert_eq!(check(&p, 999_999_999, Referenced::NotRead), Ok(()));
    }

    #[test]
    fn a_referenced_class_is_judged_by_its_value_and_must_exist() {
        let p = pool("runners")
            .reference_priority_class("batch-high")
            .build();
        assert_eq!(check(&p, 1000, Referenced::Value(1000)), Ok(()));
        assert!(check(&p, 1000, Referenced::Value(1001)).is_err());
        assert!(
            check(&p, 1000, Referenced::Missing)
                .unwrap_err()
                .contains("does not exist")
        );
        assert!(check(&p, 1000, Referenced::NotRead).is_err());
    }

    #[test]
    fn system_classes_are_refused_whatever_the_ceiling() {
        let p = pool("runners")
            .reference_priority_class("system-node-critical")
            .build();
        let why = check(&p, i32::MAX, Referenced::Value(2_000_001_000)).unwrap_err();
        assert!(why.contains("reserved"), "{why}");
    }
}
