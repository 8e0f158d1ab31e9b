//! PodMotion operator library.
