"""Tests of dspark_export.modeling (a package, so file names may repeat those of other test folders)."""
