#!/usr/bin/perl
# Functions over MAX lines (hack/check-modules.sh): prints "file:line fn name: N lines"
# for each non-test function longer than MAX (first argument) in the files given.
#
# A function runs from its `fn` line to the closing brace at the same indent, which is
# how rustfmt lays every function out (the workspace is checked by `cargo fmt`). Test
# code (from the first `#[cfg(test)]` on) and declarations without a body are left out.
# Usage: fn-lengths.pl MAX FILE...
use strict;
use warnings;

my $max = shift @ARGV;
for my $f (@ARGV) {
    open my $h, '<', $f or die "$f: $!";
    my @l = <$h>;
    close $h;
    my $stop = scalar @l;
    for my $i (0 .. $#l) {
        if ($l[$i] =~ /^\s*#\[cfg\(test\)\]/) { $stop = $i; last }
    }
    for (my $i = 0; $i < $stop; $i++) {
        next unless $l[$i] =~ /^(\s*)(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?(?:extern\s+"[^"]*"\s+)?fn\s+(\w+)/;
        my ($ind, $name) = ($1, $2);
        # A declaration (trait method without a body) ends at its `;`.
        my $j = $i;
        $j++ while $j < $#l && $l[$j] !~ /[{;]\s*$/;
        next if $l[$j] =~ /;\s*$/;
        for (my $k = $j; $k < @l; $k++) {
            if ($l[$k] =~ /^$ind\}\s*$/ || ($k == $i && $l[$k] =~ /\}\s*$/)) {
                my $n = $k - $i + 1;
                printf "%s:%d fn %s: %d lines\n", $f, $i + 1, $name, $n if $n > $max;
                last;
            }
        }
    }
}
