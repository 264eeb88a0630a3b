//! What a collective is for, in the words of the code that issued it: a thread-local label
//! that the CPU backend attaches to a mismatch error, so `collective #14: rank 0 called
//! all_reduce(avg) on f32[16] but rank 1 called all_reduce(avg) on f64[1]` also says which
//! tensors rank 0's call carried (a DDP bucket's parameters, an FSDP unit, the loss average).

use std::cell::RefCell;

thread_local! {
    static LABEL: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Runs `f` with `label` naming what the collectives it issues on this thread carry; the
/// label in force before is back afterwards (labels nest).
pub fn labelled<R>(label: &str, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<String>);
    impl Drop for Restore {
        fn drop(&mut self) {
            LABEL.with(|l| l.replace(self.0.take()));
        }
    }
    let _restore = Restore(LABEL.with(|l| l.replace(Some(label.to_owned()))));
    f()
}

/// The label in force on this thread, if any (read when a collective is issued).
pub(crate) fn current() -> Option<String> {
    LABEL.with(|l| l.borrow().clone())
}

/// `e` with `label` added when it is a mismatch between ranks: the one error where knowing
/// which tensors this rank meant tells a user where their ranks diverged.
pub(crate) fn name_mismatch(e: super::CommError, label: &str) -> super::CommError {
    match e {
        super::CommError::Mismatch(m) => {
            super::CommError::Mismatch(format!("{m}; this rank's call carried {label}"))
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_nest_and_name_mismatches_only() {
        assert_eq!(current(), None);
        labelled("outer", || {
            labelled("inner", || assert_eq!(current().as_deref(), Some("inner")));
            assert_eq!(current().as_deref(), Some("outer"));
        });
        assert_eq!(current(), None);
        let e = name_mismatch(super::super::CommError::Mismatch("m".into()), "`w`");
        assert_eq!(
            e.to_string(),
            "collective mismatch: m; this rank's call carried `w`"
        );
        let other = name_mismatch(super::super::CommError::InvalidArgument("x".into()), "`w`");
        assert!(!other.to_string().contains("`w`"));
    }
}
