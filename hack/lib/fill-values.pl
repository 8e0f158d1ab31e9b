#!/usr/bin/env perl
# Sets scalar values in a Helm values.yaml by dotted path, keeping every comment, blank
# line and key order (so `helm show values` of a release reads like the source):
#
#   perl hack/lib/fill-values.pl values.yaml image.digest=sha256:... attachment.agentImage=...
#
# Rewrites the file in place. Each path must name a `key: <scalar>` line exactly once
# (mapping keys only, no list items); a missing or repeated path fails, naming it, and
# leaves the file untouched. Used by hack/release.sh to pin the chart's defaults to the
# digests of the images it publishes.
use strict;
use warnings;

my $file = shift @ARGV or die "usage: fill-values.pl VALUES PATH=VALUE...\n";
my %want;
for (@ARGV) {
  my ($path, $value) = /^([A-Za-z0-9_.]+)=(.*)$/s or die "not PATH=VALUE: $_\n";
  die "value of $path has a quote or a newline\n" if $value =~ /["\\\n]/;
  $want{$path} = $value;
}
open(my $in, '<', $file) or die "$file: $!\n";
my @lines = <$in>;
close $in;

my (@stack, %seen);
for my $line (@lines) {
  next if $line =~ /^\s*(#|$)/;
  next unless $line =~ /^( *)([A-Za-z0-9_]+):( *)([^\n]*)$/;
  my ($indent, $key, $rest) = (length $1, $2, $4);
  pop @stack while @stack && $stack[-1][0] >= $indent;
  my $path = join('.', (map { $_->[1] } @stack), $key);
  push @stack, [$indent, $key];
  next unless exists $want{$path};
  $seen{$path}++;
  # The scalar, then an optional comment: replace the scalar only.
  my ($comment) = $rest =~ /^(?:"[^"]*"|'[^']*'|[^#\s]*)\s*(#.*)?$/
    or die "$path: not a scalar: $rest\n";
  $line = (' ' x $indent) . "$key: \"$want{$path}\"" . (defined $comment ? " $comment" : '') . "\n";
}
my @bad = grep { ($seen{$_} // 0) != 1 } sort keys %want;
die join('', map { "$_: found " . ($seen{$_} // 0) . " times in $file, want once\n" } @bad) if @bad;
open(my $out, '>', "$file.tmp") or die "$file.tmp: $!\n";
print $out @lines;
close $out or die "$file.tmp: $!\n";
rename "$file.tmp", $file or die "rename $file.tmp: $!\n";
