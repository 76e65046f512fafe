"""Pure decision logic (no Ray imports): eviction, tenancy, routing cost, remap, autoscaling."""
