//! Events, through the one shared recorder. The reason is always a condition reason
//! constant (`podmotion_api::names::reasons`), so `kubectl describe` and the status
//! tell the same story. Events are best effort: a failure is logged, never returned.

use kube::Resource;
use kube::runtime::events::{Event, EventType};

use crate::context::Context;

/// Records an Event about `obj` (only the leader records: the writer's fence).
pub async fn publish<K: Resource<DynamicType = ()>>(
    ctx: &Context,
    obj: &K,
    type_: EventType,
    reason: &str,
    action: &str,
    note: impl Into<String>,
) {
    let mut note: String = note.into();
    if note.len() > 1000 {
        let mut cut = 1000;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
    }
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: action.into(),
        secondary: None,
    };
    ctx.writer.publish(&event, &obj.object_ref(&())).await;
}
