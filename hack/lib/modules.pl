#!/usr/bin/perl
# The module graph of each crate's src/ (hack/check-modules.sh): prints every module
# cycle as "crate: a -> b -> a" and exits 1 when there is one.
#
# A module is a file (`src/a/b.rs` or `src/a/b/mod.rs` is `a::b`; lib.rs, main.rs and
# each src/bin/*.rs are roots). Module M depends on module T when M's source names a
# path into T: `crate::…`, `super::…`, `self::…` or a child declared with `mod`, the
# path resolved to the longest prefix that is a module. Every edge counts but those to
# the crate root and re-exports (`pub use`: a facade's plumbing): a parent that calls
# its child while the child names the parent's items (`super::State`) is a cycle, as
# are siblings that name each other and longer loops (issue 44: the agent's
# `service` <-> `dump`, `post_copy`, ...). Test code (from the first `#[cfg(test)]`)
# is left out.
# Usage: modules.pl SRC_DIR... ; ALLOW lines "crate: a -> b -> a" on stdin are known
# cycles (each with its issue) and are reported but do not fail.
use strict;
use warnings;
use File::Find;

my %allowed;
if (!-t STDIN) {
    while (my $l = <STDIN>) {
        $l =~ s/#.*//; $l =~ s/^\s+|\s+$//g;
        $allowed{$l} = 1 if length $l;
    }
}
my $failed = 0;

for my $src (@ARGV) {
    $src =~ s{/$}{};
    my %file_of;    # module => file
    find({ no_chdir => 1, wanted => sub {
        return unless /\.rs$/ && -f $_;
        my $rel = substr($_, length($src) + 1);
        return if $rel =~ m{^bin/.+/};  # a bin's own modules: not walked
        my $m = $rel;
        $m =~ s{\.rs$}{};
        $m =~ s{/mod$}{};
        $m = '' if $m eq 'lib' || $m eq 'main';
        $m = "bin:$1" if $rel =~ m{^bin/([^/]+)\.rs$};
        $m =~ s{/}{::}g;
        $file_of{$m} = $_;
    } }, $src);
    my %edges;
    for my $m (keys %file_of) {
        open my $fh, '<', $file_of{$m} or die "$file_of{$m}: $!";
        my $code = do { local $/; <$fh> };
        close $fh;
        $code =~ s/^\s*#\[cfg\(test\)\].*//ms;
        $code =~ s{//[^\n]*}{}g;
        $code =~ s{"(?:[^"\\]|\\.)*"}{""}g;
        my $base = $m =~ /^bin:/ ? '' : $m;
        my %children = map { ($_ => 1) } ($code =~ /\bmod\s+(\w+)\s*;/g);
        # A re-export (`pub use child::Item;`) is a facade's plumbing, not a use.
        $code =~ s/\bpub(?:\([^)]*\))?\s+use\b[^;]*;//g;
        # `p::{a, b::c}` names `p::a` and `p::b::c` (one level of braces).
        1 while $code =~ s{((?:\w+::)+)\{([^{}]*)\}}{
            join ' ', map { s/^\s+|\s+$//gr } grep { /\w/ } map { "$1$_" } split /,/, $2
        }e;
        my @paths;
        push @paths, [ $1, '' ] while $code =~ /\bcrate::((?:\w+::)*\w+)/g;
        while ($code =~ /\b((?:super::)+)((?:\w+::)*\w+)/g) {
            my ($ups, $rest) = (($1 =~ tr/:// ) / 2, $2);
            my $from = $base;
            $from = parent($from) for 1 .. $ups;
            push @paths, [ $rest, $from ];
        }
        push @paths, [ $1, $base ] while $code =~ /\bself::((?:\w+::)*\w+)/g;
        # `child::item` in a file that declares `mod child;`.
        while ($code =~ /(?<![\w:])(\w+)::\w+/g) {
            push @paths, [ $1, $base ] if $children{$1};
        }
        for my $p (@paths) {
            my ($path, $from) = @$p;
            my @parts = split /::/, $path;
            my $target;
            for my $n (reverse 0 .. @parts) {
                my $cand = join "::", grep { length } ($from, @parts[0 .. $n - 1]);
                if (exists $file_of{$cand}) { $target = $cand; last; }
            }
            next unless defined $target;
            next if $target eq $base || $target eq '';
            $edges{$m}{$target} = 1;
        }
    }
    my $crate = $src;
    $crate =~ s{/src$}{};
    for my $cycle (cycles(\%edges)) {
        my $line = "$crate: $cycle";
        if ($allowed{$line}) {
            print "known (allow-listed) cycle: $line\n";
        } else {
            print "module cycle: $line\n";
            $failed = 1;
        }
    }
}
exit $failed;

sub parent {
    my ($m) = @_;
    return '' unless $m =~ /::/;
    $m =~ s/::\w+$//;
    return $m;
}

# The strongly connected components of more than one module (Tarjan), each printed as
# one cycle through its members, in a stable order.
sub cycles {
    my ($g) = @_;
    my ($index, @stack, %on, %idx, %low, @out) = (0);
    my $visit;
    $visit = sub {
        my ($v) = @_;
        $idx{$v} = $low{$v} = $index++;
        push @stack, $v; $on{$v} = 1;
        for my $w (sort keys %{ $g->{$v} || {} }) {
            if (!exists $idx{$w}) { $visit->($w); $low{$v} = $low{$w} if $low{$w} < $low{$v}; }
            elsif ($on{$w}) { $low{$v} = $idx{$w} if $idx{$w} < $low{$v}; }
        }
        if ($low{$v} == $idx{$v}) {
            my @scc;
            while (1) { my $w = pop @stack; $on{$w} = 0; push @scc, $w; last if $w eq $v; }
            push @out, path_through([ sort @scc ], $g) if @scc > 1;
        }
    };
    $visit->($_) for grep { !exists $idx{$_} } sort keys %$g;
    return sort @out;
}

# A closed walk from the first member that reaches every member (breadth-first
# within the component), e.g. "a -> b -> c -> a".
sub path_through {
    my ($scc, $g) = @_;
    my %in = map { ($_ => 1) } @$scc;
    my $start = $scc->[0];
    my @walk = ($start);
    my %seen = ($start => 1);
    my $cur = $start;
    while (keys %seen < @$scc) {
        my $step = bfs($cur, $g, \%in, sub { !$seen{$_[0]} });
        last unless $step;
        push @walk, @$step; $seen{$_} = 1 for @$step; $cur = $walk[-1];
    }
    my $back = bfs($cur, $g, \%in, sub { $_[0] eq $start });
    push @walk, @$back if $back;
    return join ' -> ', map { $_ eq '' ? 'crate' : $_ } @walk;
}

sub bfs {
    my ($from, $g, $in, $goal) = @_;
    my %prev = ($from => undef);
    my @q = ($from);
    while (@q) {
        my $v = shift @q;
        for my $w (sort keys %{ $g->{$v} || {} }) {
            next unless $in->{$w} && !exists $prev{$w};
            $prev{$w} = $v;
            if ($goal->($w)) {
                my @p = ($w);
                unshift @p, $prev{$p[0]} while defined $prev{$p[0]} && $prev{$p[0]} ne $from;
                return \@p;
            }
            push @q, $w;
        }
    }
    return undef;
}
